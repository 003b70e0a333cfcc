# megatron_rl for GPU clusters, on an NVIDIA PyTorch (NGC) image, which already carries a CUDA build of
# torch, transformer-engine and apex (used automatically when importable).
#
# Build:  docker build -t megatron-rl .
# Run:    docker run --gpus all --ipc=host --ulimit memlock=-1 -v /models:/models -v $PWD/outputs:/work/outputs \
#           megatron-rl bash launch/torchrun.sh model=qwen2_5_0_5b model.path=/models/Qwen2.5-0.5B-Instruct \
#           data.train_files=/data/gsm8k/train.parquet data.val_files=/data/gsm8k/test.parquet algorithm=grpo
FROM nvcr.io/nvidia/pytorch:25.01-py3

WORKDIR /work
COPY . /work
# The image's torch satisfies setup.py's range, so pip keeps it; .[slurm] adds the submitit launcher.
RUN pip install --no-cache-dir -e ".[slurm]"
ENV WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
CMD ["megatron-rl", "train", "--help"]
