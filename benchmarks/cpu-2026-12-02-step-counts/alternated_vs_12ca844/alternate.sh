#!/bin/bash
# The packed step of two checkouts alternated (new, old, new, old, ...), one thread, same settings: a ratio whose
# baseline ran in the same minutes. NEW: a checkout of 9d8a5c8, OLD: one of 12ca844 (git worktree add), each with
# its .venv. Pairs 1-4 and 5-8 ran as two batches; writes {new,old}_i.json beside it into $OUT.
NEW=${NEW:?a checkout of the new code} OLD=${OLD:?a checkout of 12ca844} OUT=${OUT:-/tmp/ab}
mkdir -p "$OUT"
for i in 1 2 3 4 5 6 7 8; do
  for v in new old; do
    d=$NEW; [ $v = old ] && d=$OLD
    (cd "$d" && OMP_NUM_THREADS=1 .venv/bin/python tools/bench_train.py --contexts 512 --anchors 512 --window none \
        --paths packed --sizes smollm2 --repeats 3 --threads 1 --out "$OUT/${v}_$i.json" > "$OUT/${v}_$i.log" 2>&1)
  done
done
