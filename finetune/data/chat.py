"""Chat rendering and prompt masking: conversations -> token ids and a loss mask that is 1 on assistant turns.

    python -m pytest tests/test_data.py -q -k "chat or turn or generation or conversation"

Runs inside the cache build's map workers (cache.py), one batch of conversations per call. The chat
template comes from the tokenizer; a template with {% generation %} blocks marks the assistant turns
itself, any other is masked by the prefix rule. docs/data.md gives both rules.
"""

from __future__ import annotations

import re

import numpy as np

from finetune.data.errors import DataError
from finetune.data.samples import IGNORE

GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")  # transformers' test for a {% generation %} template


def _check_conversation(messages, where: str) -> None:
    """Roles alternate user/assistant after an optional system message; every content is text."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: messages must be a non-empty list of {{role, content}}")
    expected = "user"
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: messages[{j}] must have a text 'content'")
        role = m.get("role")
        if j == 0 and role == "system":
            continue
        if role != expected:
            raise DataError(f"{where}: messages[{j}].role is {role!r}, expected {expected!r} "
                            "(roles must alternate user/assistant after an optional system message)")
        expected = "assistant" if role == "user" else "user"


def _plain(messages) -> bool:
    """Only str role/content: what transformers' template sandboxing would copy unchanged."""
    return all(type(m) is dict and len(m) == 2 and type(m.get("role")) is str and type(m.get("content")) is str
               for m in messages)


def _render(tokenizer, conversations, add_generation_prompt: bool, plain: bool, generation: bool = False):
    """The chat template applied as `apply_chat_template(..., tokenize=False)` does: a list of strings, or with
    generation=True (return_assistant_tokens_mask) a list of (string, [(start, end) of each {% generation %}
    block]). Plain conversations go straight to the compiled template (the per-call input copying is the
    identity for them, and costs more than the rendering); anything else takes transformers' full path."""
    from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template

    special = tokenizer.special_tokens_map
    if plain:
        render = _fast_render(_compile_jinja_template(tokenizer.chat_template),
                              {"tools": None, "documents": None, "add_generation_prompt": add_generation_prompt,
                               **special}, generation)
        return [render(c) for c in conversations]
    rendered, spans = render_jinja_template(conversations=conversations, chat_template=tokenizer.chat_template,
                                            add_generation_prompt=add_generation_prompt,
                                            return_assistant_tokens_mask=generation, **special)
    return list(zip(rendered, spans)) if generation else rendered


def _fast_render(template, constants: dict, generation: bool = False):
    """messages -> template.render(messages=messages, **constants), with the variables that do not change
    merged once. jinja's render() builds each call's context by copying the template's globals (a ChainMap,
    read key by key) and the keywords: profiled, that was ~60% of the rendering time (docs/data.md).
    generation=True: (text, spans of the {% generation %} blocks), recorded by transformers' jinja extension
    (AssistantTracker), which reads the blocks rendered so far, as its `_render_with_assistant_indices` does."""
    env, base = template.environment, {**template.globals, **constants}

    def render(messages):
        ctx = env.context_class(env, {**base, "messages": messages}, template.name, template.blocks)
        try:
            if not generation:
                return env.concat(template.root_render_func(ctx))
            blocks, spans = [], []
            with env.activate_tracker(blocks, spans):
                for block in template.root_render_func(ctx):
                    blocks.append(block)
            return "".join(blocks), spans
        except Exception:  # noqa: BLE001 - what Template.render does: jinja's rewritten traceback
            return env.handle_exception()
    return render


def _first_token_at(encoding, char: int, text_len: int, where: str) -> int:
    """Index of the first token that starts at or after `char`; an error if a token straddles `char`."""
    while char < text_len:
        t = encoding.char_to_token(char)
        if t is not None:
            if encoding.offsets[t][0] < char:
                raise DataError(f"{where}: a token crosses the edge of an assistant turn; cannot mask prompts exactly")
            return t
        char += 1  # a character no token covers (e.g. dropped by the normalizer): look at the next one
    return len(encoding.ids)


def _label_mask(encoding, spans: list[tuple[int, int]], text_len: int, where: str) -> np.ndarray:
    """1 for the tokens of each assistant span [a, b) of the rendered text."""
    mask = np.zeros(len(encoding.ids), dtype=np.uint8)
    for a, b in spans:
        mask[_first_token_at(encoding, a, text_len, where): _first_token_at(encoding, b, text_len, where)] = 1
    return mask


def tokenize_chat_batch(tokenizer, conversations: list, where: list[str]) -> tuple[list, list]:
    """Token ids and loss masks (1 on assistant turns) of many conversations.

    Each conversation is tokenized once, and the assistant turns' character spans are found in its rendering:
    - a template that marks them with {% generation %} (what transformers' return_assistant_tokens_mask
      needs) renders each conversation once; each assistant turn must have exactly one such block;
    - any other template: the prefix rule, 2 x (assistant turns) more renders (`_prefix_spans`).
    Either way each span's edges must fall between tokens of the full tokenization.
    """
    check_fast_tokenizer(tokenizer)
    for k, msgs in enumerate(conversations):
        _check_conversation(msgs, where[k])
    plain = all(_plain(c) for c in conversations)  # then so are the prompts and prefixes cut from them
    if GENERATION_TAG.search(tokenizer.chat_template or ""):
        full, spans = _generation_spans(tokenizer, conversations, where, plain)
    else:
        full, spans = _prefix_spans(tokenizer, conversations, where, plain)
    enc = tokenizer(full, add_special_tokens=False)
    ids = enc["input_ids"]
    masks = [_label_mask(enc.encodings[k], spans[k], len(full[k]), where[k]) for k in range(len(conversations))]
    return ids, masks


def check_fast_tokenizer(tokenizer) -> None:
    """Chat masking maps characters to tokens (`encodings[k].char_to_token`): only a fast tokenizer (the Rust
    `tokenizers` library) returns those; a slow (Python) one returns no `encodings` at all."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"chat data needs a fast tokenizer (the `tokenizers` library) to mask prompts by character "
                        f"offsets; {type(tokenizer).__name__} ({tokenizer.name_or_path or 'in memory'}) is a slow, "
                        "Python one: save a fast one into the tokenizer folder (a tokenizer.json, e.g. from the "
                        "model's tokenizers-backed class: BertTokenizer.from_pretrained(dir).save_pretrained(dir) "
                        "for BertTokenizerLegacy), or use data.format=text")


def _generation_spans(tokenizer, conversations, where, plain) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """(renderings, assistant spans): one render per conversation, the spans its {% generation %} blocks mark."""
    full, spans = zip(*_render(tokenizer, conversations, False, plain, generation=True)) if conversations else ((), ())
    for k, msgs in enumerate(conversations):
        turns = sum(m["role"] == "assistant" for m in msgs)
        if len(spans[k]) != turns:
            raise DataError(f"{where[k]}: the chat template marks {len(spans[k])} {{% generation %}} block(s) for "
                            f"{turns} assistant turn(s); cannot mask prompts")
    return list(full), [list(s) for s in spans]


def _prefix_spans(tokenizer, conversations, where, plain) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """(renderings, assistant spans) by the prefix rule: the full conversation, and per assistant turn the
    prompt before it (with the generation prompt) and the prefix ending with it (unless that is the whole
    conversation), all as strings. Prefix consistency is checked: both must be prefixes of the full rendering."""
    owners, prompts, prefixes = [], [], []
    for k, msgs in enumerate(conversations):
        for j, m in enumerate(msgs):
            if m["role"] == "assistant":
                owners.append(k)
                prompts.append(msgs[:j])
                prefixes.append(msgs[: j + 1] if j + 1 < len(msgs) else None)  # None: the full conversation
    full = _render(tokenizer, conversations, False, plain)
    starts = _render(tokenizer, prompts, True, plain)
    rendered = iter(_render(tokenizer, [p for p in prefixes if p is not None], False, plain))
    ends = [full[k] if p is None else next(rendered) for k, p in zip(owners, prefixes)]
    spans = [[] for _ in conversations]
    for k, s, e in zip(owners, starts, ends):
        if not (full[k].startswith(s) and full[k].startswith(e) and len(s) <= len(e)):
            raise DataError(f"{where[k]}: the chat template does not render conversations prefix-consistently; "
                            "cannot mask prompts")
        spans[k].append((len(s), len(e)))
    return full, spans


# the old single-row helpers, kept for callers that tokenize one conversation (tests, notebooks)
def tokenize_chat(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Ids of the rendered conversation, and labels that are IGNORE everywhere except assistant turns."""
    (ids,), (mask,) = tokenize_chat_batch(tokenizer, [messages], ["conversation"])
    return ids, [t if m else IGNORE for t, m in zip(ids, mask)]
