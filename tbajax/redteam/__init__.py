"""Red-teaming building blocks: the TBA log reward and its schedules, evaluation metrics.

Pure functions (jnp for the reward, numpy for the metrics); the toxicity classifier lives in
`tbajax.models.toxicity_bilstm` and the reward-keyed replay buffer in `tbajax.buffer.reward_heap`.
"""

from tbajax.redteam.metrics import (
    SUCCESS_THRESHOLD,
    attack_success,
    attack_success_from_log,
    attack_success_rate,
    diversity,
    geometric_mean_toxicity,
    red_team_summary,
    unique_successful_attacks,
)
from tbajax.redteam.reward import (
    LinearRamp,
    RedTeamRewardConfig,
    apply_short_attack_prior,
    mean_log_toxicity,
    prior_log_likelihood,
    red_team_log_reward,
    replay_step,
    sample_temperature,
)

__all__ = [
    "SUCCESS_THRESHOLD",
    "LinearRamp",
    "RedTeamRewardConfig",
    "apply_short_attack_prior",
    "attack_success",
    "attack_success_from_log",
    "attack_success_rate",
    "diversity",
    "geometric_mean_toxicity",
    "mean_log_toxicity",
    "prior_log_likelihood",
    "red_team_log_reward",
    "red_team_summary",
    "replay_step",
    "sample_temperature",
    "unique_successful_attacks",
]
