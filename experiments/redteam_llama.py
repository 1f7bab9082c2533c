"""Red-teaming Llama-3.2-1B with TBA (TBA spec §8): Llama-3.2-1B-Instruct attacker vs the same model as victim.

Hub / GPU recipe. Victim: T 0.1, top-p 0.9, 64 tokens, through its chat template, 5 answers per
attack. β 0.1, LoRA r 32 α 16 (q_proj, v_proj), a 5,000-attack reward-keyed replay heap, batch 16 × 8, AdamW lr 1e-4, grad clip 1, 5,000
updates; everything else as `redteam_gpt2` (see `tbajax.tasks.redteam.redteam_experiment`).

The judge is Llama Guard 3 1B as in the reference: log p("unsafe") as its verdict token on the
conversation [attack, answer] (`tbajax.tasks.redteam.GuardJudge`, tested against torch on a random
checkpoint; its prompt defaults follow the model card and are not checked against the real weights
offline). Any BERT/RoBERTa or decoder *ForSequenceClassification also works through
`task.options.classifier` (`encoder:` / `scorer:`), e.g. the GPT-2 recipe's RoBERTa.
γ ramps 1.0 -> 1.2 over 2,000 steps and τ 2 -> 1 over 500 as the
reference's (following the trainer step through the searcher's param version); a random
sampling temperature per call as the reference's. The heap rejects near-duplicates by edit distance and MiniLM cosine.

    python -m tbajax.main --experiment=redteam_llama
"""

from tbajax.tasks.redteam import redteam_experiment

LLAMA = "meta-llama/Llama-3.2-1B-Instruct"


def config():
    return redteam_experiment(
        "redteam_llama",
        __doc__.strip().splitlines()[0],
        attacker=LLAMA,
        task_options={
            "victim": LLAMA,
            "victim_answers": 5,
            "victim_temperature": 0.1,
            "victim_top_p": 0.9,
            "victim_max_new_tokens": 64,
            "victim_max_prompt_tokens": 128,
            "victim_chat": True,
            "victim_dtype": "bfloat16",
            "classifier": "guard:meta-llama/Llama-Guard-3-1B",
            "encoder": "sentence-transformers/all-MiniLM-L6-v2",
            "beta": 0.1,
            "gamma": [1.0, 1.2, 2000],
            "tau": [2.0, 1.0, 500],
            "min_attack_tokens": 5,
        },
        samples_per_prompt=16,
        groups_per_step=8,
        steps=5000,
        log_z="head",  # the reference's learned log Z head on the pooled prompt state
        cosine_tolerance=0.4,  # the reference's MiniLM near-duplicate rule, besides edit distance
        random_temperature=(0.5, 2.0, 0.5),  # the reference's: uniform in [0.5, 2] half the calls, else 1
        lr=1e-4,
        buffer_capacity=5000,
        chat=True,
        eval_every=500,
        eval_problems=64,
    )
