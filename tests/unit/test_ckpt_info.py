"""`megatron-rl ckpt info`: reads a checkpoint's JSON files and sizes, verifies its manifest."""

import json

import pytest

from megatron_rl.apps.ckpt_info import format_summary, inspect_checkpoint
from megatron_rl.checkpoint.layout import write_manifest


def _checkpoint(root):
    step = root / "checkpoints" / "global_step_4"
    (step / "dist").mkdir(parents=True)
    (step / "rng").mkdir()
    (step / "dist" / "__0_0.distcp").write_bytes(b"w" * 3000)
    (step / "rng" / "rank_00000.pt").write_bytes(b"r" * 10)
    state = {"step": 4, "layout": {"world_size": 4, "tp": 2, "pp": 2, "dp": 1}, "roles": ["actor", "critic"],
             "optimizers": {"actor": {}, "critic": {}}}  # fmt: skip
    (step / "state.json").write_text(json.dumps(state))
    args = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
            "ffn_hidden_size": 128, "vocab_size": 29}  # fmt: skip
    (step / "megatron_rl_model.json").write_text(
        json.dumps({"tp": 2, "pp": 2, "role": "actor", "model_args": args})
    )
    write_manifest(step, 4)  # sizes and content digests, as the Checkpointer writes them
    (root / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("4")
    return step


def test_info_of_a_run_dir_finds_the_newest_checkpoint_and_verifies(tmp_path):
    step = _checkpoint(tmp_path)
    s = inspect_checkpoint(tmp_path)
    assert s.path == step and s.step == 4 and s.verified, s.problems
    assert s.layout == {"world_size": 4, "tp": 2, "pp": 2, "dp": 1}
    assert s.contents == {"actor": True, "critic": True, "optimizer": True, "rng": True, "hf_export": False}
    assert s.sizes["dist"] == 3000
    text = format_summary(s)
    assert "step        4" in text and "2 layers, hidden 64, 4 heads (2 KV groups), ffn 128, vocab 29" in text
    assert "TP=2, PP=2, DP=1" in text and "contains    actor, critic, optimizer, rng (no hf_export)" in text
    assert "verified    ok" in text


def test_a_changed_or_missing_file_fails_verification(tmp_path, capsys):
    from megatron_rl.cli import main

    step = _checkpoint(tmp_path)
    (step / "dist" / "__0_0.distcp").write_bytes(b"w" * 2999)
    (step / "rng" / "rank_00000.pt").unlink()
    s = inspect_checkpoint(step)
    assert not s.verified and any("dist/__0_0.distcp has 2999 bytes" in p for p in s.problems)
    assert any("rng/rank_00000.pt is missing" in p for p in s.problems)
    (step / "state.json").write_text((step / "state.json").read_text().replace('"step": 4', '"step": 5'))
    assert any("state.json has other content" in p for p in inspect_checkpoint(step).problems)  # same size
    with pytest.raises(SystemExit) as exit_info:
        main(["ckpt", "info", str(step)])
    assert exit_info.value.code == 1 and "verified    NO" in capsys.readouterr().out


def test_not_a_checkpoint_is_named(tmp_path, capsys):
    from megatron_rl.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["ckpt", "info", str(tmp_path)])
    assert exit_info.value.code == 2 and "holds no global_step_<N> directory" in capsys.readouterr().err


def test_cli_prints_no_dependency_warnings(tmp_path):
    import subprocess
    import sys

    _checkpoint(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "ckpt", "info", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and "verified    ok" in proc.stdout, proc.stderr
    assert "warn" not in proc.stderr.lower(), proc.stderr  # megatron-core's apex/TE notices stay quiet
