"""The parity workers' reports (tests/integration/workers/*_parity.py): one launch and one per-rank check, shared by
the megatron, DeepSeek-V3 and DeepSeek-V4 parity tests; the release-layout families' (gpt-oss, MiniMax-M2) shared
checks: the parity report, the release fixture, one-line refusals, every feature mattering."""

import json
import os
import subprocess
import sys

from conftest import ROOT, free_port


def parity_report(worker: str, *args, timeout: int) -> dict:
    """Run a parity worker on 4 gloo ranks; its one JSON line after "PARITY "."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
                           str(free_port()), f"tests/integration/workers/{worker}", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("PARITY ", 1)[1].splitlines()[0])


def check_ranks(what: str, r: dict, ranks: list[str], tol: float, rank_scale: float = 0.0) -> None:
    """One comparison: activations O(1) (so the tolerance is not vacuous), and on every rank of the layout some values
    compared (a MAX over ranks would let a stage that captured nothing pass as perfect), each within `tol`."""
    print(f"{what}: max |Δ| {r['max_abs_diff']:.2e} (scale {r['scale']:.1f})")
    assert r["scale"] > 1.0, (what, r)
    assert sorted(r["ranks"]) == ranks, (what, r)
    for rank, v in r["ranks"].items():
        print(f"  rank {rank}: max |Δ| {v['max_abs_diff']:.2e} over {v['compared']} values (scale {v['scale']:.2f})")
        assert v["compared"] > 0 and v["scale"] > rank_scale and v["max_abs_diff"] < tol, (what, rank, v)


def check_release_parity(report: dict, what: str, tol: float) -> None:
    """A release-layout worker's report (tiny_configs.megatron_parity): megatron-core needed no patch beyond the ones
    every family gets, every captured layer and the final states of every layout within `tol` (and held by some rank),
    and every layout and case within `tol` on each of the 4 ranks."""
    from dstrain.targets import cpu_compat, mcore_patches

    assert report.pop("patches") == list(cpu_compat.PATCHES) + list(mcore_patches.PATCHES)
    per_layer = report.pop("per_layer")
    for layout, cases in report.items():
        print(layout, "per captured layer max |Δ|:", per_layer[layout])
        assert min(per_layer[layout].values()) >= 0 and max(per_layer[layout].values()) < tol
        for case, r in cases.items():
            check_ranks(f"{what} megatron vs transformers, {layout}, {case}", r, ["0", "1", "2", "3"], tol)


def tiny_release(folder, model, write) -> tuple:
    """A family test's `release` fixture: (model, its state before `write` quantised it, the folder written)."""
    original = {k: v.clone() for k, v in model.state_dict().items()}
    return model, original, write(folder, model)


def check_refuses_in_one_line(check_layout, cfg, layout: tuple, match: str) -> None:
    """check_layout(cfg, *layout) refuses with a one-line UserError matching `match` that names the world.target
    setting at fault or ends by pointing at the hf backend."""
    import pytest

    from dstrain.errors import UserError

    with pytest.raises(UserError, match=match) as err:
        check_layout(cfg, *layout)
    msg = str(err.value)
    assert "\n" not in msg and ("world.target" in msg or msg.endswith("use target.backend=hf")), msg


def check_every_feature_matters(release: tuple, without, features: list[str], tol: float) -> None:
    """Each feature, undone in transformers' model alone (`without(model, original, feature)` undoes it in place and
    returns how to restore it), moves its final pre-LM-head states by far more than the parity tolerance (≥ 100×),
    and restoring it gives them back exactly."""
    import torch

    from dstrain.targets.hf import HFTarget

    model, original, _ = release
    ids = torch.randint(0, 128, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = HFTarget(model, "m")(ids).final_hidden
        moved = {}
        for feature in features:
            restore = without(model, original, feature)
            moved[feature] = (HFTarget(model, "m")(ids).final_hidden - ref).abs().max().item()
            restore()
            assert torch.equal(HFTarget(model, "m")(ids).final_hidden, ref), feature  # restored exactly
    print("max |Δ| of the final states without each feature:", {k: f"{v:.3g}" for k, v in moved.items()})
    assert min(moved.values()) > 100 * tol, moved


def check_hf_captures(release: tuple, name: str, ids, sizes: tuple) -> None:
    """A release served by the hf backend (load_hf_model + HFTarget): sizes as `sizes` (hidden, vocab, layers),
    captures and final states equal to transformers' own output_hidden_states (fp32, exact), a right-padded row
    captures what it does alone, and a decode recomputes rather than masking its cache."""
    import torch

    from dstrain.targets.hf import HFTarget, load_hf_model

    model, folder = release
    target = HFTarget(load_hf_model(folder), name, capture_layers=[0, 1, 2])
    assert (target.hidden_size, target.vocab_size, target.num_layers) == sizes
    out = target(ids)
    with torch.no_grad():
        ref = model(input_ids=ids, output_hidden_states=True).hidden_states  # [embeddings, layer 0, …, final norm]
    for j, layer in enumerate(target.capture_layers):
        assert torch.equal(out.captured[:, :, j], ref[layer + 1]), layer
    assert torch.equal(out.final_hidden, ref[-1])
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    padded, alone = target(ids, attention_mask=mask), target(ids[1:, :7])
    assert (padded.captured[1, :7] - alone.captured[0]).abs().max() <= 1e-6
    assert not target.masked_cache_ok and target.prepare_mask(mask) is mask


def check_plan_refuses_megatron(folder, megatron_recipe: str, match: str, experts: int) -> None:
    """`dstrain plan` over a release: a megatron recipe stops at the family's one line, an hf recipe sizes the model."""
    import pytest

    from dstrain.config.schema import load_recipe
    from dstrain.errors import UserError
    from dstrain.plan import build_plan

    common = [f"target.path={folder}", "target.hf_config=null", "drafter.mask_token_id=127"]
    megatron = load_recipe(ROOT / "recipes" / megatron_recipe, common + [
        "world.target.tp=2", "world.target.pp=2", "world.target.ep=2", "world.target.dp=1", "world.drafter_ranks=1",
        "world.ranks_per_node=null"])
    with pytest.raises(UserError, match=match):
        build_plan(megatron)
    plan = build_plan(load_recipe(ROOT / "recipes/tiny_moe.yaml", common + ["target.source=path"]))
    assert (plan.sizes.hidden_size, plan.sizes.num_layers, plan.sizes.num_experts) == (32, 4, experts)


def check_registry_refuses(cfg, *pieces: str) -> None:
    """The backend registry refuses `cfg` on megatron in one line naming `pieces` and the hf backend, and lists no
    megatron family for it."""
    import pytest

    from dstrain.errors import UserError
    from dstrain.targets.adapters import adapter_for, checkpoint_key, megatron_families

    with pytest.raises(UserError) as err:
        adapter_for(cfg)
    msg = str(err.value)
    assert "\n" not in msg and msg.endswith("use target.backend=hf"), msg
    assert all(p in msg for p in pieces), msg
    assert cfg.model_type not in megatron_families() and checkpoint_key(cfg, "lm_head.weight") == "lm_head.weight"


def saved_release(tmp_path_factory, auto, config: dict, name: str) -> tuple:
    """(model, folder): a random fp32 model of `config` built by the transformers Auto class `auto`, saved."""
    import torch

    from dstrain.targets.configs import config_from_dict

    torch.manual_seed(0)
    model = auto.from_config(config_from_dict(config)).float().eval()
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder)
    return model, folder
