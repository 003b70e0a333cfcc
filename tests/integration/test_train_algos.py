"""Issue-17 trainer wiring end to end on the built-in task at DP=2 (torchrun world 2): ReMax's greedy
baseline rollout, DAPO dynamic sampling + overlong shaping/filtering, IcePop with batch-normalised weights,
rejection sampling and the off-policy diagnostics, with the CISPO loss, all in one short run."""

from tests.integration.cli import metrics, train

OVERRIDES = (
    "trainer.total_training_steps=2",
    "trainer.test_freq=-1",
    "trainer.val_before_train=false",
    "algorithm.adv_estimator=remax",
    "algorithm.filter_groups.enable=true",
    "algorithm.filter_groups.max_num_gen_batches=3",
    "algorithm.overlong_filter=true",
    "reward.overlong_buffer.len=2",
    "actor.policy_loss=cispo",
    "actor.tis_mode=icepop",
    "actor.tis_batch_normalize=true",
    "actor.rollout_rs=seq_max",
)


def test_issue17_algorithms_run_at_dp2(tmp_path):
    out = tmp_path / "algos"
    proc = train(out, *OVERRIDES, nproc=2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [r for r in metrics(out) if "actor/pg_loss" in r]
    assert len(rows) == 2
    for r in rows:
        groups, kept = r["dynamic_sampling/groups"], r["dynamic_sampling/kept_groups"]
        assert (
            kept + r["dynamic_sampling/dropped_groups"] == groups and 1 <= r["dynamic_sampling/rounds"] <= 3
        )
        # rollout engine == training recompute (fp32): the importance weights are ~1 and nothing is rejected
        assert r["rollout_corr/ess"] > 0.999 and abs(r["rollout_corr/chi2_token"]) < 1e-3
        assert (
            abs(r["rollout_corr/training_ppl"] - r["rollout_corr/rollout_ppl"])
            < 1e-3 * r["rollout_corr/rollout_ppl"]
        )
        assert r["rollout_rs/token_frac"] == 0 and abs(r["tis_batch_norm_factor"] - 1) < 1e-3
        assert r["reward_extra/overlong_penalty"] <= 0
