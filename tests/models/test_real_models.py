"""Our runtime against transformers on the real packaged models (same converted weights)."""

from __future__ import annotations

import pytest
import torch

from kvblend.generation import SamplingParams, generate_ids

PROMPT = ("Retrieval-augmented generation answers questions from documents. The documents are "
          "retrieved first, then the model reads them together with the question and writes an "
          "answer. Caching the key-value states of each document saves most of the prefill work, "
          "because the same documents come back for many questions in different orders and with "
          "different neighbours, and only a few tokens need their states recomputed.")


def check_against_transformers(loaded) -> None:
    """Our logits and greedy tokens against transformers', on the fp32 reference path
    (decode reading the fp32 weights; the packed decode weights state their KL instead)."""
    kind = loaded.model.decode_weights
    loaded.model.pack_decode_weights("fp32")
    try:
        _check_against_transformers(loaded)
    finally:
        loaded.model.pack_decode_weights(kind)


def _check_against_transformers(loaded) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(loaded.folder), dtype=torch.float32).eval()
    ids = loaded.tokenizer(PROMPT)["input_ids"][:64]
    assert len(ids) == 64
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        ref_gen = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    cache = loaded.model.new_cache(len(ids))
    ours = loaded.model(torch.tensor(ids), cache, logits_for="all")
    assert (ours - ref).abs().max().item() <= 1e-3
    assert generate_ids(loaded.model, ids, SamplingParams(max_tokens=32, ignore_eos=True)) == ref_gen


def test_smollm2_matches_transformers(smollm2) -> None:
    check_against_transformers(smollm2)


@pytest.mark.qwen
def test_qwen_coder_matches_transformers() -> None:
    from kvblend.models import load_model

    check_against_transformers(load_model("qwen2.5-coder-0.5b", decode_weights="fp32"))


def test_smollm2_chat_answers_in_text(smollm2) -> None:
    from kvblend.generation import collect, render_chat, stream

    ids = render_chat(smollm2.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    done = collect(stream(smollm2.model, smollm2.tokenizer, ids, SamplingParams(max_tokens=16),
                          smollm2.eos_token_ids), len(ids))
    assert "Paris" in done.text


def test_fast_tokenizer_path_equals_autotokenizer(smollm2) -> None:
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(smollm2.folder))
    text = "Hello world!\n\nThe  quick brown fox, naïve café — 1234.\n\n\n"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    ours = smollm2.tokenizer
    assert ours(text)["input_ids"] == auto(text)["input_ids"]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (ours.bos_token_id, ours.eos_token_id, len(ours)) == (auto.bos_token_id, auto.eos_token_id, len(auto))
