"""dstrain table: the bootstrap on known data, the equal-budget rule against the trainer's own count,
and the whole pipeline end to end (two families, a tiny target, a few steps) with its resume."""

import json
import math
import shutil

import pytest
import torch
import yaml

from conftest import ROOT, run_tool
from dstrain.data import corpus
from dstrain.eval.bootstrap import macro_interval, paired_difference, prompt_totals, ratio_interval
from dstrain.eval.metrics import acceptance_stats


def _rollout(prompts: int, p_accept: float, seed: int, gamma: int = 4, rounds=(3, 12)):
    """Rounds of `prompts` requests: accepted ~ a geometric prefix of Bernoulli(p_accept), capped at γ."""
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(rounds[0], rounds[1], (prompts,), generator=g)
    request = torch.repeat_interleave(torch.arange(prompts), n)
    accepted = (torch.rand(len(request), gamma, generator=g) < p_accept).long().cumprod(1).sum(1)
    return {"request": request, "proposed": torch.full_like(accepted, gamma), "accepted": accepted}


def test_bootstrap_point_is_the_decoders_tau_and_the_interval_behaves():
    logs = _rollout(30, 0.6, seed=0)
    tokens, rounds = prompt_totals(logs)
    ci = ratio_interval(tokens, rounds, seed=0)
    assert ci["tau"] == pytest.approx(acceptance_stats(logs["proposed"], logs["accepted"], 4)["tau"], abs=1e-6)  # the decoder averages in fp32
    assert ci["lo"] < ci["tau"] < ci["hi"] and ci["prompts"] == 30
    assert ratio_interval(tokens, rounds, seed=0) == ci  # a fixed seed gives the same interval
    many = ratio_interval(*prompt_totals(_rollout(480, 0.6, seed=1)), seed=0)
    assert many["hi"] - many["lo"] < 0.5 * (ci["hi"] - ci["lo"])  # 16× the prompts: about a quarter of the width
    # every prompt with the same τ: nothing to resample but that value
    same = ratio_interval(torch.tensor([6.0, 9.0, 3.0]), torch.tensor([2.0, 3.0, 1.0]))
    assert same["lo"] == pytest.approx(3.0) and same["hi"] == pytest.approx(3.0)
    # a prompt that ended at its first token has no round and changes nothing
    padded = prompt_totals({k: v for k, v in logs.items()}, prompts=31)
    assert ratio_interval(*padded, seed=0)["tau"] == pytest.approx(ci["tau"]) and len(padded[0]) == 31


def test_bootstrap_interval_covers_the_true_tau():
    """95 % intervals from 200 independent evaluations of 30 prompts cover the population τ about 95 % of the time."""
    pop = _rollout(20000, 0.55, seed=99)
    t_pop, r_pop = prompt_totals(pop)
    true = float(t_pop.sum() / r_pop.sum())
    covered = 0
    for rep in range(200):
        t, r = prompt_totals(_rollout(30, 0.55, seed=1000 + rep))
        ci = ratio_interval(t, r, samples=1000, seed=rep)
        covered += ci["lo"] <= true <= ci["hi"]
    assert 0.88 <= covered / 200 <= 0.99, covered


def test_paired_and_macro_intervals():
    a, b = prompt_totals(_rollout(40, 0.7, seed=3)), prompt_totals(_rollout(40, 0.3, seed=4))
    diff = paired_difference(a, b, seed=0)
    assert diff["lo"] > 0 and diff["lo"] <= diff["diff"] <= diff["hi"]
    zero = paired_difference(a, a, seed=0)
    assert zero["lo"] == zero["hi"] == zero["diff"] == 0
    with pytest.raises(ValueError):
        paired_difference(a, prompt_totals(_rollout(39, 0.3, seed=4)))
    macro = macro_interval({"x": a, "y": b}, seed=0)
    ta, tb = ratio_interval(*a)["tau"], ratio_interval(*b)["tau"]
    assert macro["tau"] == pytest.approx((ta + tb) / 2) and macro["lo"] < macro["tau"] < macro["hi"]


# ------------------------------------------------------------------------------------------ a tiny world
@pytest.fixture(scope="module")
def tiny_world(tmp_path_factory, tiny_lm_dir):
    """A corpus 'regenerated' by a tiny random Llama (SmolLM2's tokenizer) and a recipe training against it."""
    root = tmp_path_factory.mktemp("table")
    folder = root / "corpus"
    folder.mkdir()
    shutil.copy(corpus.DEFAULT / "prompts.jsonl", folder / "prompts.jsonl")
    prompts = [json.loads(line) for line in open(folder / "prompts.jsonl")][:24]
    with open(folder / "conversations.jsonl", "w") as fh:
        for i, p in enumerate(prompts):
            words = p["turns"][0].split()
            answer = " ".join(words[::-1] * 2)  # some text with structure; its content does not matter here
            msgs = [{"role": "user", "content": p["turns"][0]}, {"role": "assistant", "content": answer}]
            fh.write(json.dumps({"id": p["id"], "domain": p["domain"], "messages": msgs, "target": "tiny-lm",
                                 "generator": "hf", "sampling": {"temperature": 1.0}, "finish_reasons": ["stop"],
                                 "new_tokens": len(words)}) + "\n")
    corpus.pack(folder, str(tiny_lm_dir))
    recipe = yaml.safe_load(open(ROOT / "recipes" / "smollm2_moe.yaml"))
    recipe["run"]["name"] = "tiny"
    recipe["target"] = {"name": "tiny-lm", "source": "path", "path": str(tiny_lm_dir), "dtype": "float32", "num_capture": 2}
    recipe["drafter"].update(head_rank=8, ffn={"type": "dense", "intermediate_size": 64})
    recipe["data"]["max_length"] = 256
    recipe["anchors"]["per_sequence"] = 6
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return root


def test_mtp_budget_matches_the_block_families_by_the_trainers_count(tiny_world):
    from dstrain.data.shards import build_shards
    from dstrain.data.tokenize import TokenizeConfig
    from dstrain.config.schema import load_recipe
    from dstrain.reproduce.families import match_budget, sample_stream, supervised_positions
    from transformers import AutoTokenizer

    r = load_recipe(tiny_world / "recipe.yaml", [f"data.shards={tiny_world / 'budget_shards'}"])
    corpus.unpack(tiny_world / "corpus", tiny_world / "train.jsonl", "train")
    build_shards([str(tiny_world / "train.jsonl")], str(tiny_world / "budget_shards"), AutoTokenizer.from_pretrained(r.target.path),
                 TokenizeConfig(max_length=256, min_loss_tokens=8), "tiny-lm", overwrite=True, progress=False)
    plan = match_budget(r, 7)
    block, mtp = plan["block"], plan["mtp"]
    stream = sample_stream(r, mtp["steps"])
    assert block["positions"] == supervised_positions(r, stream, 7)  # the trainer's packing, valid labels
    assert mtp["positions"] == supervised_positions(r, stream, mtp["steps"], anchors=mtp["anchors"], gamma=1)
    assert mtp["anchors"] > block["anchors"] and abs(mtp["positions"] / block["positions"] - 1) < 0.03
    near = [supervised_positions(r, stream, mtp["steps"], anchors=mtp["anchors"] + d, gamma=1) for d in (-1, 1)]
    assert all(abs(n - block["positions"]) >= abs(mtp["positions"] - block["positions"]) for n in near)


def test_reproduce_table_end_to_end_and_resume(tiny_world):
    out = tiny_world / "out"
    args = ["-m", "dstrain", "table", "--recipe", tiny_world / "recipe.yaml", "--corpus", tiny_world / "corpus",
            "--families", "dspark-markov,mtp", "--steps", "4", "--eval-prompts", "3", "--max-new-tokens", "6",
            "--batch", "2", "--curve-points", "2", "--curve-prompts", "1", "--curve-new-tokens", "4", "--out", out]
    first = run_tool(*args, timeout=900)
    res = json.loads((out / "results.json").read_text())
    fams = res["families"]
    assert set(fams) == {"dspark-markov", "mtp"} and res["domains"] == ["math", "code", "chat"]
    for fam, f in fams.items():
        for d, cell in f["tau"].items():
            assert cell["lo"] <= cell["tau"] <= cell["hi"] and cell["prompts"] == 3
            assert cell["tau"] == pytest.approx(cell["reported_tau"], abs=1e-6)  # the bootstrap's point is evaluate's τ
            assert len(f["conditional_acceptance"][d]) == (5 if fam != "mtp" else 1)
        assert f["macro"]["lo"] <= f["macro"]["tau"] <= f["macro"]["hi"]
        assert [p["step"] for p in f["curve"]["points"]] == [math.ceil(f["steps"] / 2), f["steps"]]
        run = yaml.safe_load((out / "runs" / fam / "recipe.yaml").read_text())
        assert run["anchors"]["per_sequence"] == f["anchors_per_sequence"] and run["train"]["steps"] == f["steps"]
        assert run["train"]["feature_cache_dir"] == str(out / "feature_cache")
        assert sorted(p.name for p in (out / "runs" / fam / "checkpoints").glob("step-*")) == [f"step-{f['steps']}"]
    # one target pass: the cache holds the recipe's capture layers and the last one, and MTP-1 reads it from there
    cache = {fam: json.loads((out / "runs" / fam / "summary.json").read_text())["feature_cache"] for fam in fams}
    layers = yaml.safe_load((out / "runs" / "mtp" / "recipe.yaml").read_text())["train"]["feature_cache_layers"]
    assert layers[-1] == yaml.safe_load((out / "runs" / "mtp" / "recipe.yaml").read_text())["target"]["capture_layers"][0]
    assert cache["mtp"]["feature_cache/hits"] > 0 and cache["dspark-markov"]["feature_cache/misses"] > 0
    if fams["mtp"]["steps"] == fams["dspark-markov"]["steps"]:
        assert cache["mtp"]["feature_cache/misses"] == 0, cache["mtp"]
    block, mtp = fams["dspark-markov"]["supervised_positions"], fams["mtp"]["supervised_positions"]
    assert abs(mtp / block - 1) < 0.05 and fams["mtp"]["anchors_per_sequence"] > fams["dspark-markov"]["anchors_per_sequence"]
    assert fams["mtp"]["gamma"] == 1 and fams["dspark-markov"]["gamma"] == 5
    # position 1, per prompt: its pooled ratio is the decoder's conditional acceptance at k = 1; paired against DSpark
    for fam, f in fams.items():
        ev = json.loads((out / "eval" / f"{fam}.json").read_text())
        for d in res["domains"]:
            t = ev["totals"][d]
            assert sum(t["pos1_accepted"]) / sum(t["pos1_reached"]) == pytest.approx(f["conditional_acceptance"][d][0])
    p1 = res["position1"]["mtp"]
    assert set(res["position1"]) == {"mtp"} and p1["lo"] <= p1["diff"] <= p1["hi"]
    assert p1["diff"] == pytest.approx(p1["acceptance"] - p1["reference"])
    # one rule for the table: 3 neighbour pairs (one per benchmark), MTP-1 against DSpark, position 1 against DSpark,
    # every interval Bonferroni-corrected over those 5
    assert res["comparisons"] == 5 and res["level"] == pytest.approx(0.99) and p1["level"] == pytest.approx(0.99)
    vs = res["against_dspark"]["mtp"]
    assert set(res["against_dspark"]) == {"mtp"} and vs["level"] == pytest.approx(0.99)
    assert vs["corrected"][0] <= vs["ci95"][0] <= vs["ci95"][1] <= vs["corrected"][1]  # wider than the uncorrected
    assert vs["diff"] == pytest.approx(fams["mtp"]["macro"]["tau"] - fams["dspark-markov"]["macro"]["tau"])
    assert vs["ci95"][0] <= vs["diff"] <= vs["ci95"][1]
    for d, sep in res["separation"].items():
        pair = sep["pairs"][0]
        assert pair["separated"] == (pair["difference"]["lo"] > 0 or pair["difference"]["hi"] < 0)
        assert sep["separated"] == pair["separated"]
    md = (out / "results.md").read_text()
    assert "Position 1 against DSpark" in md and "Every family against DSpark (Markov)" in md
    assert "DSpark (Markov)" in md and "MTP-1" in md and "GSM8K τ [95% CI]" in md and "dstrain table" in md
    for png in ("tau_ci.png", "acceptance.png", "learning_curves.png"):
        assert (out / png).stat().st_size > 5000
    # the same command again: every stage reused, the same numbers
    again = run_tool(*args, timeout=300)
    assert again.stdout.count("reused (config unchanged)") == 2 + 3 * 2, again.stdout
    assert json.loads((out / "results.json").read_text())["families"]["mtp"]["tau"] == fams["mtp"]["tau"]
    # more prompts: the trained runs are reused, only the evaluations are redone
    more = run_tool(*args[:-1], out, "--eval-prompts", "4", timeout=600)
    assert "train mtp: reused" in more.stdout and "evaluate mtp: done" in more.stdout
    assert json.loads((out / "results.json").read_text())["families"]["mtp"]["tau"]["math"]["prompts"] == 4
    # another curve setting after the intermediate checkpoints were deleted: those families train again
    redo = run_tool(*args[:-1], out, "--eval-prompts", "4", "--curve-prompts", "2", timeout=600)
    assert redo.stdout.count("intermediate checkpoints were deleted: training again") == 2, redo.stdout
    assert all(len(f["curve"]["points"]) == 2 for f in json.loads((out / "results.json").read_text())["families"].values())
    assert "done" in first.stdout


def test_user_errors_are_one_line(tiny_world):
    for extra, needle in ((["--families", "dspark,nope"], "--families"), (["--eval-prompts", "1"], "--eval-prompts"),
                          (["--recipe", "missing.yaml"], "--recipe")):
        proc = run_tool("-m", "dstrain", "table", "--out", tiny_world / "err", *extra, check=False)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and needle in proc.stderr, proc.stderr


def test_pooled_paired_difference_and_stratified_benchmark_sample():
    from dstrain.eval.bootstrap import pooled_paired_difference
    from dstrain.eval.prompts import sampled_benchmark_prompts

    hi = [{d: prompt_totals(_rollout(30, 0.7, seed=s * 10 + i)) for i, d in enumerate("xy")} for s in range(2)]
    lo = [{d: prompt_totals(_rollout(30, 0.3, seed=s * 10 + i + 5)) for i, d in enumerate("xy")} for s in range(2)]
    diff = pooled_paired_difference(hi, lo, seed=0, level=0.975)
    mean = lambda runs: sum(ratio_interval(*r[d])["tau"] for r in runs for d in "xy") / 4  # noqa: E731
    assert diff["diff"] == pytest.approx(mean(hi) - mean(lo)) and 0 < diff["lo"] < diff["diff"] < diff["hi"]
    same = pooled_paired_difference(hi, hi, seed=0)
    assert same["lo"] == same["hi"] == same["diff"] == 0
    # the benchmark sample: random with a seed, stratified (every MT-Bench category), deterministic
    a = sampled_benchmark_prompts(["math", "code", "chat"], 30, seed=0)
    assert a == sampled_benchmark_prompts(["math", "code", "chat"], 30, seed=0)
    chat = [p for p in a if p["domain"] == "chat"]
    assert len(a) == 90 and len({p["category"] for p in chat}) == 8
    assert max(sum(p["category"] == c for p in chat) for c in {p["category"] for p in chat}) <= 4
    first30 = [p["id"] for p in sampled_benchmark_prompts(["math"], 30, seed=1)]
    assert first30 != [f"gsm8k/{i}" for i in range(30)] and first30 != [p["id"] for p in a if p["domain"] == "math"]


def test_paper2_preset_end_to_end_and_resume(tiny_world):
    """--preset paper2 --quick on the tiny world: three families × two seeds, 5 : 1 depth, block 7, the same annealed
    steps for every family and no early stop (held-out τ of a subset after each epoch for the curve only), the last
    checkpoint evaluated on the full held-out set and the stratified benchmark sample at T = 1 and T = 0 with per-prompt
    counts at every draft position; a record per run; the table from records; a rerun reuses every stage; records of
    another protocol are refused and missing runs named."""
    out, committed = tiny_world / "paper", tiny_world / "committed"
    committed.mkdir()
    args = ["-m", "dstrain", "table", "--preset", "paper2", "--quick", "--recipe", tiny_world / "recipe.yaml",
            "--corpus", tiny_world / "corpus", "--out", out, "--record-to", committed]
    run_tool(*args, timeout=1200)
    res = json.loads((out / "results.json").read_text())
    names = sorted(f"{f}-s{s}" for f in ("dspark-markov", "dflash", "eagle3") for s in (0, 1))
    assert sorted(res["runs"]) == names and res["missing"] == [] and res["temperatures"] == ["1", "0"]
    assert sorted(p.stem for p in committed.glob("*.json")) == names
    steps = set()
    for name, r in res["runs"].items():
        recipe = yaml.safe_load((out / "runs" / name / "recipe.yaml").read_text())
        assert recipe["drafter"]["num_layers"] == (1 if r["family"] == "eagle3" else 5)
        assert recipe["drafter"]["block_size"] == 7 and recipe["eval"]["every"] == 3 and recipe["run"]["seed"] == r["seed"]
        assert recipe["eval"]["per_domain"] == 2 and recipe["eval"]["patience"] == 0  # the curve subset, no stop
        steps.add(recipe["train"]["steps"])
        assert r["ending"]["stop"] == "schedule" and r["ending"]["epochs_run"] == 2
        assert r["ending"]["lr_evaluated"] == pytest.approx(recipe["train"]["min_lr"], rel=0.05)  # annealed
        points = r["curve"]["points"]
        assert [p["step"] for p in points] == [3, 6]
        rec = json.loads((committed / f"{name}.json").read_text())
        assert rec["schema"] == 2 and set(rec["evals"]) == {"1", "0"} and rec["training"]["fixed_schedule"]
        for temp, parts in rec["evals"].items():
            assert parts["held_out"]["trained_steps"] == parts["benchmarks"]["trained_steps"] == recipe["train"]["steps"]
            assert parts["benchmarks"]["temperature"] == float(temp)
            assert len(parts["benchmarks"]["prompt_ids"]) == 6 and len(parts["held_out"]["prompt_ids"]) == 9
            for d, tot in parts["benchmarks"]["totals"].items():
                pos = tot["positions"]
                assert len(pos["reached"]) == len(tot["rounds"]) == 2 and all(len(x) == 7 for x in pos["reached"])
                # every round verifies position 1; a position is reached only after the one before it was accepted
                assert [x[0] for x in pos["reached"]] == tot["rounds"]
                assert all(r2 <= a1 for rs, acc in zip(pos["reached"], pos["accepted"]) for r2, a1 in zip(rs[1:], acc))
        assert rec["code"]["commit"] != "unknown" and rec["protocol_key"] == res["protocol_key"]
    assert len(steps) == 1  # the same steps for every family
    text = (out / "results.md").read_text()
    assert "## T = 1 (sampled)" in text and "## T = 0 (greedy)" in text and "over seeds" in text
    for png in ("learning_curves.png", "tau_seeds.png", "positions.png"):
        assert (out / png).stat().st_size > 5000
    again = run_tool(*args, timeout=300)
    assert again.stdout.count("reused (config unchanged)") == 1 + 5 * 6, again.stdout

    # the table from committed records alone, with a run missing: named, the rest assembled
    (committed / "eagle3-s1.json").unlink()
    table = tiny_world / "table"
    done = run_tool("-m", "dstrain", "table", "--preset", "paper2", "--records", committed, "--out", table, timeout=120)
    assert "Missing runs (1 of 6 remain): eagle3-s1" in done.stdout
    assert json.loads((table / "results.json").read_text())["tables"]["0"]["versus_dspark"]["eagle3"]["seeds"] == [0]
    # a record of another protocol is refused, naming the setting that differs
    rec = json.loads((committed / "dflash-s1.json").read_text())
    rec["protocol"]["sizes"]["eval_new_tokens"] = 99
    rec["protocol_key"] = "0123456789abcdef"
    (committed / "dflash-s1.json").write_text(json.dumps(rec))
    bad = run_tool("-m", "dstrain", "table", "--preset", "paper2", "--records", committed, "--out", table, check=False,
                   timeout=120)
    assert bad.returncode != 0 and "another protocol" in bad.stderr and "sizes.eval_new_tokens: 6 vs 99" in bad.stderr


def test_paper3_trains_dflash_as_deepspecs_config_does(tiny_world):
    """--preset paper3 end to end for one run: the reference implementation's settings reach the trained run's recipe
    (DFlash: the anchor predicts, cross-entropy alone, dense MLP of the target's width, full attention; every family:
    DeepSpec's schedule and betas, weights from N(0, the target's initializer_range)) and its record is protocol 3's."""
    out, records = tiny_world / "paper3", tiny_world / "records3"
    records.mkdir()
    run_tool("-m", "dstrain", "table", "--preset", "paper3", "--quick", "--recipe", tiny_world / "recipe.yaml", "--corpus",
             tiny_world / "corpus", "--out", out, "--record-to", records, "--run", "dflash:0", timeout=900)
    recipe = yaml.safe_load((out / "runs" / "dflash-s0" / "recipe.yaml").read_text())
    d, loss, train = recipe["drafter"], recipe["loss"], recipe["train"]
    assert d["type"] == "dflash" and d["sample_from_anchor"] and (loss["alpha_ce"], loss["alpha_tv"]) == (1.0, 0.0)
    assert d["ffn"]["type"] == "dense" and d["ffn"]["intermediate_size"] == 64 and d["sliding_window"] is None
    assert d["init_std"] == 0.02 and loss["gamma_decay"] == 4.0  # the tiny Llama's initializer_range
    assert (train["lr"], train["min_lr"], list(train["betas"])) == (6e-4, 0.0, [0.9, 0.999])
    rec = json.loads((records / "dflash-s0.json").read_text())
    assert rec["protocol"]["preset"] == "paper3" and set(rec["evals"]) == {"1", "0"}
    # the record's schedule is the one trained (the page's "evaluated at lr" reads it), not the base recipe's
    assert rec["training"]["lr"] == {"peak": 6e-4, "min": 0.0, "warmup": train["warmup_steps"], "steps": train["steps"]}


def test_protocol_1_keeps_its_key_so_its_records_stay_one_table():
    """Protocol 2's fields are not part of protocol 1: a protocol 1 run made today would join the committed records."""
    from dstrain.config.files import resolve_recipe_path
    from dstrain.data.corpus import resolve
    from dstrain.reproduce import paper as PP
    from dstrain.reproduce.paper_record import load, protocol
    from dstrain.reproduce.stages import key_of

    committed = load([ROOT / "benchmarks" / "paper-runs"])[0]
    proto = protocol(PP.PaperSizes(), str(resolve_recipe_path("smollm2_moe")), resolve("smollm2_moe"),
                     committed["protocol"]["target"], PP.DEPTH)
    assert key_of(proto) == committed["protocol_key"]
    two = protocol(PP.PAPER2, str(resolve_recipe_path("smollm2_moe")), resolve("smollm2_moe"), committed["protocol"]["target"],
                   PP.DEPTH)
    assert key_of(two) != committed["protocol_key"] and two["preset"] == "paper2"


def test_every_family_is_a_valid_recipe_that_changes_what_its_name_says():
    """Each family's overrides load on the table's base recipe (a misspelt key or value is a recipe error here, not
    an hour into a background table), and the position-1 ablations differ from DSpark (Markov) in their one setting."""
    from dstrain.config.schema import load_recipe
    from dstrain.reproduce.families import FAMILIES, family_overrides

    base = ROOT / "dstrain" / "recipes" / "smollm2_moe.yaml"
    recipes = {name: load_recipe(base, family_overrides(name, 30)) for name in FAMILIES}
    ref = recipes["dspark-markov"]
    assert ref.drafter.head == "markov" and ref.drafter.confidence and ref.loss.alpha_conf > 0
    assert recipes["dspark-anchor-context"].drafter.anchor_context and not ref.drafter.anchor_context
    assert recipes["dspark-conf-0.3"].loss.alpha_conf == 0.3
    assert recipes["dspark-rank-64"].drafter.head_rank == 64 != ref.drafter.head_rank
    no_conf = recipes["dspark-no-conf"]
    assert not no_conf.drafter.confidence and no_conf.loss.alpha_conf == 0 and no_conf.drafter.head == "markov"
    assert recipes["dflash-anchor"].drafter.head == "none" and recipes["dflash-anchor"].drafter.sample_from_anchor
    assert recipes["mtp"].target.capture_layers == [29] and recipes["eagle3"].drafter.num_layers == 1
