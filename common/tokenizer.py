"""Text <-> token ids for GGUF and Hugging Face models, built on Hugging Face `tokenizers`.

A GGUF file carries its vocabulary as plain arrays; we rebuild the equivalent `tokenizers`
pipeline so that ids match llama.cpp's tokenizer (llama-vocab.cpp) for the same file:
  * `gpt2` vocabularies: byte-level BPE, split first by the regexes that
    `tokenizer.ggml.pre` names (the same table llama.cpp keeps);
  * `llama` vocabularies (SentencePiece): llama.cpp merges the adjacent pair whose joined
    piece has the highest score, which is a BPE whose merge ranks are ordered by score,
    plus `<0xNN>` byte fallback and a `▁` prefix at the start and after each special token.
Control and user-defined tokens become added tokens, so `<|im_start|>` in a rendered chat
template stays one token. A rendered `Prompt` (common/chat_template.py) marks where the
caller's messages spelt a control token; those spans are encoded as plain text, as
llama.cpp does with `parse_special` off, so only the template makes control tokens.
"""
from __future__ import annotations

import functools
import json
import logging
import re
from pathlib import Path

from gguf import TokenType
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from .chat_template import PLACEHOLDER, Prompt
from .gguf_file import open_gguf_cached
from .regular_file import check_model_folder

log = logging.getLogger(__name__)

EOT_NAMES = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>")

# Pre-tokenizer regexes by `tokenizer.ggml.pre`, from llama-vocab.cpp. Where llama.cpp
# rewrote a Hugging Face regex for its own engine, we keep the original: Oniguruma (used
# by `tokenizers`) supports `(?i:` and `\p{Lu}`, and both sides then split alike.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
          r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_CASED = (  # the cased letters (Lu, Ll, Lt) as llama.cpp lists them
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943")
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"]
_STARCODER = [r"\p{N}", _GPT2]
_PRE_REGEXES: dict[str, list[str]] = {
    "default": _DEFAULT,
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "jina-v1-en", "jina-v2-es",
                     "jina-v2-de", "jina-es", "jina-de", "gigachat", "trillion"), [_GPT2]),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx",
                     "smaug-bpe", "chatglm-bpe"), [_LLAMA3]),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), [_QWEN2]),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                     "minerva-7b"), _STARCODER),
    **dict.fromkeys(("gpt-4o", "llama4"), [_GPT4O]),
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"],
    "deepseek-llm": ["[\r\n]", rf"\s?[{_DEEPSEEK_CASED}]+",
                     "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
                     r"\s+$", _CJK, r"\p{N}+"],
    "deepseek-coder": ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"],
    "deepseek-v3": [r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?"
                    r"[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
}
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"}  # as llama.cpp


def _spm_merges(tokens: list[str], scores: list[float], types: list[int],
                vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a mergeable piece into two known pieces, best joined score first."""
    ranked = []
    for piece, score, kind in zip(tokens, scores, types):
        if kind in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.BYTE):
            continue
        for i in range(1, len(piece)):
            if piece[:i] in vocab and piece[i:] in vocab:
                ranked.append((-score, vocab[piece[:i]], vocab[piece[i:]], piece[:i], piece[i:]))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _from_metadata(meta: dict) -> "Tokenizer":
    """Build from `tokenizer.*` GGUF metadata given as plain Python values."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    vocab: dict[str, int] = {}
    for i, piece in enumerate(tokens):
        vocab.setdefault(piece, i)  # a few vocabularies repeat a piece; llama.cpp keeps the first
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if kind == "gpt2":
        pre = meta.get("tokenizer.ggml.pre")
        if pre is None:
            log.warning("GGUF lacks tokenizer.ggml.pre; using llama.cpp's default split")
            pre = "default"
        elif pre not in _PRE_REGEXES:
            log.warning("unknown tokenizer.ggml.pre %r; splitting with the GPT-2 regex", pre)
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        hf = HFTokenizer(models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES))
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), "isolated") for r in _PRE_REGEXES.get(pre, [_GPT2])]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        hf.decoder = decoders.ByteLevel()
        add_bos = pre in _IGNORE_MERGES if add_bos is None else add_bos
    elif kind == "llama":
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        unk = meta.get("tokenizer.ggml.unknown_token_id")
        merges = _spm_merges(tokens, scores, types, vocab)
        hf = HFTokenizer(models.BPE(vocab, merges, byte_fallback=True, fuse_unk=True,
                                    unk_token=None if unk is None else tokens[unk]))
        steps = [normalizers.Replace(" ", "▁")]
        unsteps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if meta.get("tokenizer.ggml.add_space_prefix", True):
            steps.insert(0, normalizers.Prepend("▁"))
            unsteps.append(decoders.Strip(" ", 1, 0))
        hf.normalizer, hf.decoder = normalizers.Sequence(steps), decoders.Sequence(unsteps)
        add_bos = True if add_bos is None else add_bos
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (expected gpt2 or llama)")
    hf.add_tokens([AddedToken(tokens[i], special=types[i] == TokenType.CONTROL, normalized=False)
                   for i in range(len(tokens))
                   if types[i] in (TokenType.CONTROL, TokenType.USER_DEFINED)])
    extra = {meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")} - {None}
    return Tokenizer(hf, bos_id=meta.get("tokenizer.ggml.bos_token_id"),
                     eos_id=meta.get("tokenizer.ggml.eos_token_id"), add_bos=bool(add_bos),
                     chat_template=meta.get("tokenizer.chat_template"), extra_eot=extra)


def open_tokenizer(path: str | Path) -> "Tokenizer":
    """The tokenizer of a model given as a GGUF file or a Hugging Face folder."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    return Tokenizer.from_hf_dir(path) if path.is_dir() else Tokenizer.from_gguf(path)


class Tokenizer:
    """Encode/decode for one model; `bos_id`/`eos_id` may be None where a model has none."""

    def __init__(self, hf: HFTokenizer, *, bos_id: int | None, eos_id: int | None,
                 add_bos: bool, chat_template: str | None = None, extra_eot=()):
        self._hf = hf
        self.bos_id, self.eos_id, self.add_bos = bos_id, eos_id, add_bos
        self.chat_template = chat_template
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self.bos_text = "" if bos_id is None else hf.id_to_token(bos_id)
        self.eos_text = "" if eos_id is None else hf.id_to_token(eos_id)
        named = {hf.token_to_id(name) for name in EOT_NAMES}
        self.eot_ids = frozenset((named | {eos_id} | set(extra_eot)) - {None})
        # the control tokens' texts (ChatTemplate's `specials`); user-defined tokens such as
        # `<think>` stay tokens even in message text, as in llama.cpp
        control = {t.content: i for i, t in hf.get_added_tokens_decoder().items()
                   if t.special and t.content}
        self.control_texts = tuple(sorted(control, key=len, reverse=True))
        self._control_ids = control
        self._control_re = re.compile("(" + "|".join(map(re.escape, self.control_texts)) + ")") \
            if control else None
        self._plain: HFTokenizer | None = None      # built on the first forged prompt

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        return cls.from_gguf_fields(open_gguf_cached(path).fields)

    @classmethod
    def from_gguf_fields(cls, fields) -> "Tokenizer":
        """From a GGUFReader's `fields`, so a loader that already opened the file reuses them."""
        return _from_metadata({key: field.contents() for key, field in fields.items()
                               if key.startswith("tokenizer.")})

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        """From a Hugging Face model folder: tokenizer.json + tokenizer_config.json."""
        path = Path(path)
        check_model_folder(path)                   # a FIFO among its files is never opened
        hf = HFTokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        ids = {}
        for role in ("bos", "eos"):
            token = config.get(f"{role}_token")
            if isinstance(token, dict):
                token = token.get("content")
            ids[role] = hf.token_to_id(token) if token else None
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        add_bos = config.get("add_bos_token")
        if add_bos is None:  # otherwise the post-processor in tokenizer.json decides
            add_bos = ids["bos"] is not None and hf.encode("a").ids[:1] == [ids["bos"]]
        eos = _read_json(path / "generation_config.json").get("eos_token_id")
        return cls(hf, bos_id=ids["bos"], eos_id=ids["eos"], add_bos=add_bos,
                   chat_template=template, extra_eot=eos if isinstance(eos, list) else [eos])

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids; special-token text (e.g. `<|im_start|>`) becomes the special token,
        except where a rendered Prompt says it came from a message (then it is text)."""
        if isinstance(text, Prompt) and text.literals and self._control_re is not None:
            ids = self._encode_shielded(text)
        else:
            # encode_batch, not encode: only the batch call releases the GIL, and a 3 MB
            # prompt in `encode` froze the frontend's event loop (/health, every stream) 15 s
            ids = self._hf.encode_batch([text], add_special_tokens=False)[0].ids
        add = self.add_bos if add_bos is None else add_bos
        return [self.bos_id, *ids] if add and self.bos_id is not None else ids

    def _encode_shielded(self, prompt: Prompt) -> list[int]:
        """The split `tokenizers` makes around added tokens, made by hand: the template's
        control tokens are cut out as ids, and each run between them (the forged texts
        put back) is encoded with control tokens read as text. A run is what the plain
        encoder would have seen, so an honest prompt gets the same ids either way."""
        if self._plain is None:
            self._plain = HFTokenizer.from_str(self._hf.to_str())
            self._plain.encode_special_tokens = True
        runs, cuts, run = [], [], []            # cuts[i]: the control id after runs[i]
        pieces = PLACEHOLDER.split(prompt.shielded)
        for i, piece in enumerate(pieces):
            if i % 2:                           # a placeholder's number: the forged text
                n = int(piece)
                run.append(prompt.literals[n] if n < len(prompt.literals) else piece)
                continue
            parts = self._control_re.split(piece)
            for j, part in enumerate(parts):
                if j % 2:                       # the template's own control token
                    runs.append("".join(run))
                    cuts.append(self._control_ids[part])
                    run = []
                else:
                    run.append(part)
        runs.append("".join(run))
        ids: list[int] = []
        for k, enc in enumerate(self._plain.encode_batch(runs, add_special_tokens=False)):
            ids += enc.ids
            if k < len(cuts):
                ids.append(cuts[k])
        return ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for: a text of N characters is at least
        N / this many tokens, known without tokenizing it (the frontend refuses a prompt
        that cannot fit the context before the tokenizer's work, seconds per megabyte)."""
        return max(map(len, self._hf.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, ids, skip_special: bool = False) -> str:
        return self._hf.decode(list(ids), skip_special_tokens=skip_special)

    def token_str(self, token_id: int) -> str:
        """One token's text as it reads inside longer output (SentencePiece's leading space
        kept; a lone byte of a multi-byte character shows as U+FFFD), e.g. for logprobs.
        Decoding after a one-letter anchor keeps decoders from stripping that space."""
        piece = self._hf.id_to_token(token_id)
        decoder = self._hf.decoder
        return piece if decoder is None else decoder.decode(["a", piece])[1:]

    def detokenizer(self, skip_special: bool = False) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


class IncrementalDetokenizer:
    """Streams text as tokens arrive; the pushes and `flush()` concatenate to `decode(ids)`.

    vLLM's scheme: `ids[prefix:read]` is a window already emitted, kept only as context so
    that decoders which look at neighbours (SentencePiece's leading-space strip, byte
    fallback, byte-level pieces) decode new tokens exactly as in the full text. New text is
    `decode(ids[prefix:])` past `decode(ids[prefix:read])`; while it ends in U+FFFD a
    character is still incomplete and is held back. Each push decodes only the window.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tokenizer, self._skip_special = tokenizer, skip_special
        self._ids: list[int] = []
        self._read = 0  # ids[:read] are emitted; ids[0] starts the context window

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still held back, with U+FFFD for bytes that never formed a character."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        done = self._tokenizer.decode(self._ids[:self._read], self._skip_special)
        text = self._tokenizer.decode(self._ids, self._skip_special)
        if len(text) <= len(done) or (text.endswith("\ufffd") and not final):
            return ""
        self._ids = self._ids[self._read:]  # the just-emitted ids become the next window
        self._read = len(self._ids)
        return text[len(done):]
