"""The learner workloads the benchmarks share: one table, imported by benchmark_learner,
roofline, gemm_ceiling, saved_activations and benchmark_multigpu (none of them imports another
for it).

W1 B256 x 2 updates, W2 B256 x 8, W3 B2048 x 8 (UniLab's G1 default), W4 B8192 x 4; policy
frequency 2; W1-W3 with G1 walk-flat's dims, W4 with wider observations. U64: the 256-env G1
trainings at 64 updates per iteration (time to reward; benchmark_multigpu's gradient-sync cells).
"""

G1_DIMS = dict(obs_dim=98, critic_obs_dim=101, action_dim=29)
WORKLOADS = {
    "W1": dict(batch_size=256, updates_per_step=2, policy_frequency=2, **G1_DIMS),
    "W2": dict(batch_size=256, updates_per_step=8, policy_frequency=2, **G1_DIMS),
    "W3": dict(batch_size=2048, updates_per_step=8, policy_frequency=2, **G1_DIMS),
    "W4": dict(batch_size=8192, updates_per_step=4, policy_frequency=2, obs_dim=160, critic_obs_dim=289, action_dim=29),
}
U64 = dict(batch_size=256, updates_per_step=64, policy_frequency=2, **G1_DIMS)
