"""make engine-check's comparison (tools/engine_check.py): rows matched by prompt id whatever order vLLM returns them
in, outputs compared up to the end-of-turn id and against the target's own greedy answer, per-position counts, the
share of rows that rejected a draft, and vLLM's speed-up against the target alone."""

import importlib.util

from conftest import ROOT

spec = importlib.util.spec_from_file_location("engine_check", ROOT / "tools" / "engine_check.py")
EC = importlib.util.module_from_spec(spec)
spec.loader.exec_module(EC)

EOS = [2]


def _data():
    return {"prompt_ids": ["a", "b", "c", "d"], "prompt_domains": ["math", "code", "chat", "math"], "eos": EOS,
            "target_greedy": [[5, 6, 2], [7, 8, 9, 2], [4], [1, 1, 2]]}


def _sides():
    # dstrain keeps the end-of-turn id, vLLM drops it; vLLM returns the rows in another order
    ds = {"rounds": [2, 3, 1, 2], "accepted": [1, 1, 0, 2], "accepted_per_position": [[1, 0], [1, 0], [0, 0], [1, 1]],
          "outputs": [[5, 6, 2], [7, 8, 9, 2], [4], [1, 1, 2]]}
    rows = {"a": (2, 1, [1, 0], [5, 6]), "b": (3, 1, [1, 0], [7, 8, 9]), "c": (1, 0, [0, 0], [4]),
            "d": (2, 2, [1, 1], [1, 1])}
    vl = {"output_tokens": 9, "decode_s": 1.0, "target_alone": {"output_tokens": 9, "decode_s": 2.0},
          "prompts": [{"id": k, "rounds": r, "accepted": a, "draft_tokens": 2 * r, "accepted_per_position": p,
                       "output_ids": o} for k, (r, a, p, o) in reversed(rows.items())]}
    return ds, vl


def test_rows_are_matched_by_id_and_compared_whole():
    ds, vl = _sides()
    cmp = EC.compare("dflash", ds, vl, _data())
    assert cmp["equal"] and [r["prompt"] for r in cmp["rows"]] == ["a", "b", "c", "d"]
    assert cmp["rejecting_rows"] == 1.0 and cmp["vllm_speedup"] == 2.0
    assert cmp["position_1_rate"] == 3 / 8 and cmp["exercised"]


def test_a_different_token_count_or_output_is_caught():
    for change in ("per_position", "output", "greedy", "missing"):
        ds, vl = _sides()
        data = _data()
        if change == "per_position":
            ds["accepted_per_position"][1] = [0, 1]
        elif change == "output":
            vl["prompts"][0]["output_ids"] = [1, 3]  # row d (vLLM's first)
        elif change == "greedy":
            data["target_greedy"][2] = [4, 4]
        else:
            vl["prompts"] = vl["prompts"][1:]
        cmp = EC.compare("dflash", ds, vl, data)
        assert not cmp["equal"], change
        assert sum(not r["equal"] for r in cmp["rows"]) == 1, change


def test_drafts_accepted_everywhere_do_not_exercise_the_rejection_path():
    ds, vl = _sides()
    for v in vl["prompts"]:
        v["draft_tokens"] = v["accepted"]
    cmp = EC.compare("dflash", ds, vl, _data())
    assert cmp["rejecting_rows"] == 0 and not cmp["exercised"]
