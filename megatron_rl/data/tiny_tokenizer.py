"""A character-level tokenizer built in code, for tests and the embedded default task (no downloads).

Every character of the alphabet is one token; special tokens (pad, bos, eos, unk and the chat markers)
are matched whole before the per-character split. The chat template is ChatML-like, so prompts look like
what Qwen-style instruct models see.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, IM_START, IM_END)

DEFAULT_ALPHABET = string.ascii_letters + string.digits + string.punctuation + " \n"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The template renders role names and newlines, so their characters must always be in the vocabulary.
_TEMPLATE_CHARS = "systemuserassistant\n"


def build_char_tokenizer(
    alphabet: str = DEFAULT_ALPHABET, chat_template: str | None = CHAT_TEMPLATE
) -> PreTrainedTokenizerFast:
    """Build a char-level ``PreTrainedTokenizerFast`` over ``alphabet``.

    Ids 0..5 are ``<pad> <s> </s> <unk> <|im_start|> <|im_end|>``; then the sorted unique characters of
    ``alphabet`` (plus those the chat template needs). Characters outside the vocabulary map to
    ``<unk>``. Pass ``chat_template=None`` for a tokenizer without a chat template (base-model style).
    The result round-trips through ``save_pretrained`` / ``from_pretrained``.
    """
    if not alphabet:
        raise ValueError("build_char_tokenizer: alphabet is empty; pass the characters the task uses")
    chars = sorted(set(alphabet) | set(_TEMPLATE_CHARS))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # A character class rather than "." so that newlines are isolated too.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=chat_template,
        padding_side="left",
    )
