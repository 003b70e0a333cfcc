"""The tokenizer must fit the model: every id it can produce needs a trained embedding row."""

from __future__ import annotations


class TokenizerMismatchError(ValueError):
    """The tokenizer's vocabulary is larger than the model's embedding."""


def check_tokenizer_fits(tokenizer, vocab_size: int, model_dir: str) -> None:
    """Refuse a tokenizer with more tokens (added tokens included) than the model's ``vocab_size``
    embedding rows: its extra ids would sample untrained padding rows, or fail with an ``IndexError`` after
    generation."""
    n = len(tokenizer)
    if n <= vocab_size:
        return
    raise TokenizerMismatchError(
        f"the tokenizer in {model_dir} has {n} tokens (added tokens included) but the model's embedding has "
        f"{vocab_size} rows (vocab_size in {model_dir}/config.json): ids {vocab_size}..{n - 1} have no trained "
        "row. Use the tokenizer that was saved with this model (model.path), or resize the embedding "
        "(transformers: model.resize_token_embeddings(len(tokenizer)), then save_pretrained) and train it."
    )
