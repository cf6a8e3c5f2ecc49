"""/tokenize, /detokenize and /tokenizer_info with the server's own tokenizer and chat
template."""

from __future__ import annotations

from typing import Any

import jinja2

from shoal.engine.async_llm import AsyncLLM
from shoal.engine.input_processor import ProcessedPrompt
from shoal.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from shoal.entrypoints.openai.responses import (
    DetokenizeResponse,
    MultiModalPlaceholder,
    TokenizeResponse,
)
from shoal.entrypoints.openai.serving_chat import messages_to_dicts
from shoal.entrypoints.openai.serving_models import ServedModels

# tokenizer_config fields that name files on the server's disk: not for clients.
_PRIVATE_FIELDS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "content"):  # AddedToken
        return obj.content
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


class OpenAIServingTokenization:
    def __init__(self, engine: AsyncLLM, models: ServedModels):
        self.engine = engine
        self.models = models

    def _tokenizer(self):
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this server runs without a tokenizer (--skip-tokenizer-init)")
        return tok

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """The prompt's token ids as a request would have them. A chat's images and videos
        are fetched, decoded and processed (on the media threads) as the chat route does:
        the tokens are the expanded prompt and mm_placeholders name each item's span and
        content hash (what the engine's block hashes mix in)."""
        self.models.check(req.model)
        tok = self._tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise ValueError("pass exactly one of prompt and messages")
        placeholders = None
        if req.messages is not None:
            kwargs = dict(req.chat_template_kwargs or {})
            if req.tools:
                kwargs.setdefault("tools", req.tools)
            if req.documents:
                kwargs.setdefault("documents", req.documents)
            mm = self.engine.inputs.mm
            media: list[Any] | None = [] if mm is not None else None
            messages = messages_to_dicts(req.messages,
                                         mm.image_placeholder if mm is not None else None,
                                         media)
            try:
                text = self.engine.inputs.apply_chat_template(
                    messages, add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                    chat_template=req.chat_template, chat_template_kwargs=kwargs)
            except (jinja2.TemplateError, TypeError) as e:
                raise ValueError(f"the chat template failed: {e}") from e
            ids = self.engine.inputs.encode(text, bool(req.add_special_tokens), "the chat")
            if media:
                assert mm is not None
                prompt = await mm.offload(self._with_media, ids, media)
                ids = prompt.prompt_token_ids
                placeholders = [MultiModalPlaceholder(modality=f.modality,
                                                      identifier=f.identifier,
                                                      offset=f.offset, length=f.length)
                                for f in prompt.mm_features or ()]
        else:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = self.engine.inputs.encode(req.prompt, special)
        return TokenizeResponse(
            count=len(ids), max_model_len=self.engine.max_model_len, tokens=list(ids),
            token_strs=tok.convert_ids_to_tokens(ids) if req.return_token_strs else None,
            mm_placeholders=placeholders)

    def _with_media(self, ids: list[int], media: list[Any]) -> ProcessedPrompt:
        inputs = self.engine.inputs
        return inputs.with_images(ProcessedPrompt(None, ids), {"image": inputs.mm.load(media)})

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.models.check(req.model)
        vocab = self.engine.vocab_size
        for t in req.tokens:
            if not 0 <= t < vocab:
                raise ValueError(f"tokens must be in [0, {vocab}) (got {t})")
        return DetokenizeResponse(prompt=self._tokenizer().decode(req.tokens))

    def tokenizer_info(self) -> dict[str, Any]:
        """The tokenizer's configuration as vLLM's /tokenizer_info gives it (what lm-eval's
        tokenizer_backend=remote reads), without the server's file paths."""
        tok = self._tokenizer()
        config = {k: v for k, v in dict(getattr(tok, "init_kwargs", None) or {}).items()
                  if k not in _PRIVATE_FIELDS}
        info = _jsonable(config)
        info["tokenizer_class"] = type(tok).__name__
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            if info.get(name) is None and getattr(tok, name, None) is not None:
                info[name] = str(getattr(tok, name))
        info.setdefault("model_max_length", self.engine.max_model_len)
        if getattr(tok, "chat_template", None):
            info["chat_template"] = tok.chat_template
        return info
