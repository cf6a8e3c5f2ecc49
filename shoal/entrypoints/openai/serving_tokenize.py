"""/tokenize and /detokenize with the server's own tokenizer and chat template."""

from __future__ import annotations

from shoal.engine.async_llm import AsyncLLM
from shoal.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from shoal.entrypoints.openai.responses import DetokenizeResponse, TokenizeResponse
from shoal.entrypoints.openai.serving_chat import messages_to_dicts
from shoal.entrypoints.openai.serving_models import ServedModels


class OpenAIServingTokenization:
    def __init__(self, engine: AsyncLLM, models: ServedModels):
        self.engine = engine
        self.models = models

    def _tokenizer(self):
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer")
        return tok

    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.models.check(req.model)
        tok = self._tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise ValueError("pass exactly one of prompt and messages")
        if req.messages is not None:
            text = self.engine.inputs.apply_chat_template(
                messages_to_dicts(req.messages), add_generation_prompt=req.add_generation_prompt,
                chat_template_kwargs=req.chat_template_kwargs)
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len,
                                tokens=list(ids))

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.models.check(req.model)
        vocab = self.engine.vocab_size
        for t in req.tokens:
            if not 0 <= t < vocab:
                raise ValueError(f"tokens must be in [0, {vocab}) (got {t})")
        return DetokenizeResponse(prompt=self._tokenizer().decode(req.tokens))
