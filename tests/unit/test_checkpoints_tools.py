"""checkpoints_tools CLIs: clear one-paragraph errors, and one end-to-end run under torchrun (4 procs)."""

import json
import subprocess
import sys

import torch

from tests.distributed.launch import REPO, free_port

TOOLS = REPO / "checkpoints_tools"
sys.path.insert(0, str(TOOLS))
sys.path.insert(0, str(REPO / "tests" / "distributed" / "workers"))

import hf_to_megatron  # noqa: E402
import megatron_to_hf  # noqa: E402
from models_tiny import hf_logits, make_tiny_hf  # noqa: E402


def test_missing_hf_dir_fails_with_one_paragraph(tmp_path, capsys):
    assert hf_to_megatron.main(["--hf-path", str(tmp_path / "nope"), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf_to_megatron: error:") and "nope" in err and "config.json" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_missing_weights_and_unsupported_arch(tmp_path, capsys):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "vocab_size": 10,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
            }
        )
    )
    assert hf_to_megatron.main(["--hf-path", str(tmp_path), "--output", str(tmp_path / "o")]) == 2
    assert "model.safetensors" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    assert hf_to_megatron.main(["--hf-path", str(tmp_path), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "BertModel" in err and "LlamaForCausalLM" in err


def test_missing_checkpoint_fails_clearly(tmp_path, capsys):
    assert megatron_to_hf.main(["--checkpoint", str(tmp_path / "none"), "--output", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert (
        megatron_to_hf.main(["--checkpoint", str(tmp_path / "empty"), "--output", str(tmp_path / "o")]) == 2
    )
    assert "neither a torch_dist checkpoint" in capsys.readouterr().err


def _run(cmd: list[str]) -> str:
    env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_cli_round_trip_under_torchrun_loads_in_transformers(tmp_path):
    hf = make_tiny_hf("qwen3", tmp_path / "hf", seed=4)
    (hf / "tokenizer_config.json").write_text("{}")
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=4",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
    ]
    log = _run(
        [
            *torchrun,
            str(TOOLS / "hf_to_megatron.py"),
            "--hf-path",
            str(hf),
            "--output",
            str(ckpt),
            "--tp",
            "2",
            "--pp",
            "2",
            "--format",
            "torch_dist",
        ]
    )
    assert "Qwen3ForCausalLM (qwen3) -> torch_dist TP=2 PP=2" in log and "47 tensors" in log
    log = _run(
        [sys.executable, str(TOOLS / "megatron_to_hf.py"), "--checkpoint", str(ckpt), "--output", str(out)]
    )
    assert "-> HF safetensors: 47 tensors" in log
    assert (out / "tokenizer_config.json").is_file()
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    assert torch.equal(hf_logits(out, ids), hf_logits(hf, ids))


def test_single_process_torch_dist_says_what_it_wrote(tmp_path):
    hf = make_tiny_hf("qwen2", tmp_path / "hf", seed=1)
    args = ["--hf-path", str(hf), "--output", str(tmp_path / "ckpt"), "--tp", "2", "--pp", "2"]
    log = _run([sys.executable, str(TOOLS / "hf_to_megatron.py"), *args])
    assert "-> torch_dist TP=1 PP=1" in log  # what it wrote...
    assert "--tp 2 --pp 2 asked for, one process wrote it at TP=1 PP=1" in log  # ...and why that still fits
    assert "loads at TP=2 PP=2" in log
