"""PNG figures: position-wise acceptance curves, reliability diagrams, the static-threshold sweep."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save(fig, path: Path, *axes) -> Path:
    """Grid and legend on `axes`, then the figure written as a PNG and closed: every plot's last lines."""
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def acceptance_curves(results: dict, out: Path) -> Path:
    domains = sorted({d for r in results["drafters"].values() for d in r["domains"]})
    fig, axes = plt.subplots(1, len(domains), figsize=(4.2 * len(domains), 3.4), squeeze=False, sharey=True)
    for ax, domain in zip(axes[0], domains):
        for name, res in results["drafters"].items():
            if domain in res["domains"]:
                cond = res["domains"][domain]["conditional_acceptance"]
                ax.plot(range(1, len(cond) + 1), cond, marker="o", label=f"{name} (τ={res['domains'][domain]['tau']:.2f})")
        ax.set_title(domain)
        ax.set_xlabel("draft position k")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("conditional acceptance")
    fig.suptitle("Position-wise conditional acceptance (positions 1..k−1 accepted)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def reliability(pred_before, pred_after, labels, out: Path, bins: int = 10) -> Path:
    """One panel per position: mean predicted survival vs observed survival, before and after STS."""
    n = len(labels)
    fig, axes = plt.subplots(1, n, figsize=(3.0 * n, 3.1), squeeze=False)
    for k, ax in enumerate(axes[0]):
        for pred, style, name in ((pred_before[k], "o--", "raw"), (pred_after[k], "s-", "STS")):
            idx = (pred * bins).long().clamp(max=bins - 1)
            xs, ys = [], []
            for b in range(bins):
                sel = idx == b
                if sel.sum() >= 5:
                    xs.append(float(pred[sel].mean()))
                    ys.append(float(labels[k][sel].float().mean()))
            ax.plot(xs, ys, style, label=name, markersize=4)
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8)
        ax.set_title(f"prefix 1..{k + 1}")
        ax.set_xlabel("predicted survival")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("observed survival")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def threshold_sweep(sweeps: dict[str, list[dict]], out: Path) -> Path:
    domains = sorted(sweeps)
    fig, axes = plt.subplots(1, len(domains), figsize=(4.2 * len(domains), 3.4), squeeze=False)
    for ax, domain in zip(axes[0], domains):
        rows = sweeps[domain]
        ts = [r["threshold"] for r in rows]
        width = (ts[1] - ts[0]) * 0.8 if len(ts) > 1 else 0.05
        ax.bar(ts, [r["tokens_per_step"] for r in rows], width=width, color="#7aa6d8", label="tokens / step")
        ax.set_xlabel("survival threshold")
        ax.set_title(domain)
        twin = ax.twinx()
        twin.plot(ts, [r["acceptance_rate"] for r in rows], "o-", color="#c0392b", label="acceptance rate")
        twin.set_ylim(0, 1.02)
        if domain == domains[-1]:
            twin.set_ylabel("acceptance rate")
    axes[0][0].set_ylabel("tokens per step")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def serving(curves: dict[str, list[dict]], out: Path) -> None:
    """pareto.png: aggregate throughput vs per-user speed (paper Fig. 8); budget.png: verified drafts per request
    per step vs concurrency (Fig. 9)."""
    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    for label, pts in curves.items():
        ax.plot([p["per_user_tps"] for p in pts], [p["aggregate_tps"] for p in pts], "o-", markersize=3, label=label)
    ax.set(xlabel="per-user tokens / s", ylabel="aggregate tokens / s", title="Throughput vs interactivity")
    save(fig, out / "pareto.png", ax)
    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    for label, pts in curves.items():
        ax.plot([p["concurrency"] for p in pts], [p["verify_budget"] for p in pts], "o-", markersize=3, label=label)
    ax.set(xscale="log", xlabel="concurrent requests R", ylabel="verified draft tokens / request / step",
           title="Verification budget vs concurrency")
    save(fig, out / "budget.png", ax)
