"""A new user's first hour in one short run: GSM8K (preprocessed by the example script) on the built-in tiny
model with a custom reward, every logger, and what the run leaves behind (checkpoint, HF export, report,
wandb offline files, an MLflow store), read back with the tools a user reaches for."""

import json
import subprocess
import sys
import textwrap

from tests.distributed.launch import REPO, cpu_env
from tests.integration.cli import metrics

QUESTIONS = [
    (f"Tom has {a} apples and buys {b}. How many?", a + b) for a, b in [(3, 4), (2, 5), (1, 1), (6, 2)]
]
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.25, "has_digit": float(any(c.isdigit() for c in solution_str))}
"""


def _run(args, tmp_path, env=None):
    proc = subprocess.run(
        args, capture_output=True, text=True, timeout=900, env=env or cpu_env(), cwd=tmp_path
    )
    assert proc.returncode == 0, f"{args}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_gsm8k_on_the_tiny_model_with_a_custom_reward_and_every_tool(tmp_path, monkeypatch):
    raw = tmp_path / "gsm8k_raw"
    raw.mkdir()
    for split in ("train", "test"):
        lines = [json.dumps({"question": q, "answer": f"{a}\n#### {a}"}) for q, a in QUESTIONS * 2]
        (raw / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    data = tmp_path / "gsm8k"
    _run([sys.executable, str(REPO / "examples/data_preprocess/gsm8k.py"), "--local_dir", str(raw),
          "--output_dir", str(data)], tmp_path)  # fmt: skip
    (tmp_path / "reward.py").write_text(textwrap.dedent(REWARD))
    out = tmp_path / "run"
    env = {k: v for k, v in cpu_env().items() if not k.startswith("WANDB_")}  # no WANDB_MODE, no key
    env |= {"HOME": str(tmp_path), "NETRC": str(tmp_path / "no_netrc"), "WANDB_SILENT": "true"}
    train = _run([sys.executable, "-m", "megatron_rl.cli", "train", f"trainer.output_dir={out}",
                  f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
                  "data.max_prompt_length=256", "rollout.max_new_tokens=8", "rollout.n=2",
                  "data.train_batch_size=8", "data.val_batch_size=8", "trainer.total_training_steps=2",
                  "trainer.test_freq=2", "trainer.val_before_train=false", "trainer.log_generations_freq=1",
                  f"reward.custom_reward_function.path={tmp_path / 'reward.py'}",  # reward_fn stays auto
                  "trainer.logger=[console,jsonl,wandb,mlflow]", "trainer.save_hf=true"], tmp_path, env)  # fmt: skip
    text = train.stdout + train.stderr
    rows = metrics(out)
    # item 7: chat-format GSM8K prompts render with the tiny model's tokenizer; item 6: the custom function
    # scores (auto + path = custom) and its extra key is a metric
    assert [r["critic/score/mean"] for r in rows] == [0.25, 0.25]
    assert all(0.0 <= r["reward/has_digit/mean"] <= 1.0 for r in rows)
    # item 5: the final checkpoint is kept, its place printed, and the HF export loads in transformers
    ckpt = out / "checkpoints" / "global_step_2"
    assert f"final checkpoint in {ckpt}" in text
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(ckpt / "hf")
    assert model.config.num_hidden_layers == 2 and AutoTokenizer.from_pretrained(ckpt / "hf").chat_template
    # item 4: wandb without a key or WANDB_MODE logs offline (logger.wandb_mode's default)
    assert list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    # item 11: a normal run prints our lines, not the dependencies' chatter
    for noise in (
        "INFO",
        "FutureWarning",
        "Writing model shards",
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "Traceback",
    ):
        assert noise not in text, noise
    # item 2: trainer.output_dir given: Hydra's files go there, no outputs/ tree
    assert (out / ".hydra" / "config.yaml").is_file() and not (tmp_path / "outputs").exists()
    # the report, written at the end of the run
    assert f"report in {out / 'report.html'}" in text
    assert {p.name for p in (out / "report").glob("*.png")} >= {"score.png", "kl.png", "timing.png"}
    # mlflow: a local store MLflow's client reads
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv(
        "MLFLOW_ALLOW_FILE_STORE", "true"
    )  # MLflow 3 reads local file stores behind this switch
    client = MlflowClient(tracking_uri=(out / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("megatron_rl").experiment_id])
    assert [m.value for m in client.get_metric_history(run.info.run_id, "critic/score/mean")] == [0.25, 0.25]
    # ckpt info: step, layout, contents, verification
    info = _run([sys.executable, "-m", "megatron_rl.cli", "ckpt", "info", str(out)], tmp_path).stdout
    assert "step        2" in info and "TP=1, PP=1, DP=1" in info and "verified    ok" in info
    assert "contains    actor, optimizer, rng, hf_export (no critic)" in info
    # score the run's own generations with the gsm8k rule (the file carries data_source and ground_truth)
    scored = _run([sys.executable, "-m", "megatron_rl.cli", "score", "reward=gsm8k",
                   f"input={out / 'generations.jsonl'}"], tmp_path).stdout  # fmt: skip
    assert '"rows": 4' in scored and '"openai/gsm8k"' in scored


def test_ctrl_c_stops_without_a_traceback(tmp_path):
    import signal
    import time

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", f"trainer.output_dir={out}", "trainer.logger=[jsonl]",
           "trainer.val_before_train=false", "trainer.save_final=false", "trainer.write_report=false"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cpu_env(), cwd=tmp_path
    )
    deadline = time.monotonic() + 600
    while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends, mid-training
    stdout, stderr = proc.communicate(timeout=300)
    assert "Traceback" not in stderr and "Traceback" not in stdout, stderr[-3000:]
