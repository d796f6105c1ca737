#!/usr/bin/env python3
"""Fixtures for tests/qwen3.rs: a tiny Qwen tokenizer and a tiny random Qwen3, with what
transformers and diffusers' FLUX.2 [klein] and Z-Image pipelines make of captions.

Writes tests/fixtures/qwen3/:
  tokenizer/          tokenizer.json: a byte-level BPE learned here with the tokenizers library
                      over a small corpus, in the pipeline of Qwen's (NFC, Qwen2's split regex
                      "isolated", byte level without a prefix space, no unknown token), with
                      Qwen's special tokens <|endoftext|>, <|im_start|>, <|im_end|> and the
                      non-special added tokens <think>, </think> after the learned vocabulary
                      (Qwen's own vocabulary cannot be downloaded here); tokenizer_config.json
                      as Qwen3's (Qwen2Tokenizer, pad <|endoftext|>, eos <|im_end|>, Qwen3's
                      chat template, below)
  text_encoder/       config.json + model.safetensors of a tiny random Qwen3ForCausalLM as
                      transformers saves one (keys under "model.", the language-model head
                      tied to the embedding and so not saved, as Qwen3-4B's; bf16 weights, as
                      released): width 32, 4 query heads over 2 key/value heads of width 16
                      (so 4 x 16 != 32, as Qwen3-4B's 32 x 128 != 2560), MLP 64, 4 layers,
                      RoPE base 1e6, eps 1e-6
  qwen_3_tiny.safetensors  the same weights as ComfyUI's single files hold them ("model."
                      keys, no config)
  tokens.json         per caption and template (FLUX.2 [klein]: enable_thinking=False;
                      Z-Image: True): the text apply_chat_template renders (checked here to
                      equal FLAME's documented rendering), transformers' input_ids and
                      attention_mask at 48 tokens (three captions are cut) and, for
                      [klein], at the pipelines' 512
  qwen3_4b_keys.json  every key and shape of Qwen3-4B as transformers saves it (the
                      Qwen3ForCausalLM of Qwen/Qwen3-4B's config.json, built on the meta device,
                      no weights; the tied head not saved), the file FLUX.2 [klein] 4B's and
                      Z-Image's text_encoder/ shards hold and ComfyUI's qwen_3_4b.safetensors
  outputs.safetensors ids / mask (the [klein] prompts at 48 tokens), hidden.0 and hidden.4
                      (hidden_states 0, the embedding output, and 4, the final-normed state,
                      with the mask), unmasked.2 (no mask), klein.context
                      (Flux2KleinPipeline.encode_prompt with text_encoder_out_layers (1, 2, 3),
                      the layers (9, 18, 27) of 36 scaled to 4, max_sequence_length 48: its
                      three thirds of the features are hidden_states 1, 2 and 3, not stored
                      again), zimage.ids / zimage.mask and
                      zimage.context.<n> (ZImagePipeline.encode_prompt, hidden_states[-2],
                      each caption's valid tokens), computed in f64 from the bf16 weights,
                      stored in f32

Deterministic (fixed seeds, one thread). Run: /work/pyenv/bin/python scripts/make_qwen3_fixtures.py
(any Python with the versions below). Made with torch 2.15.0, transformers 5.24.0,
diffusers 0.42.1, tokenizers 0.23.3, safetensors 0.8.0.
"""

import hashlib
import json
import os
import shutil

import diffusers
import numpy as np
import safetensors.torch
import tokenizers
import torch
import transformers
from diffusers import Flux2KleinPipeline, ZImagePipeline
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import processors, trainers
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

torch.set_num_threads(1)
diffusers.utils.logging.set_verbosity_error()
transformers.utils.logging.set_verbosity_error()
ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
OUT = os.path.join(ROOT, "tests", "fixtures", "qwen3")

# Qwen2's pre-tokenizer split (transformers models/qwen2/tokenization_qwen2.py
# PRETOKENIZE_REGEX, the Split of Qwen2 / Qwen3's tokenizer.json).
PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                     r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# Qwen3's chat template (tokenizer_config.json "chat_template" of the Qwen3 release, e.g.
# Qwen/Qwen3-8B). For one user message with the generation prompt it renders
# "<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n", plus
# "<think>\n\n</think>\n\n" when enable_thinking is false.
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

LONG = " ".join(["a very detailed painting of a small orange cat sitting on a red mat"] * 3)
# Empty, plain, accents, CJK, emoji, contractions / whitespace runs / newlines / digits,
# special-token text inside a caption (read as those tokens, as transformers does), and one
# longer than the 48 tokens (cut, the chat prompt's tail with it).
CAPTIONS = [
    "",
    "a photo of a cat",
    "café crème, naïve résumé à l'école",
    "日本語のキャプション、東京の夜",
    "a cat 🐱 wearing a hat 🎩 and 👍🏽",
    "it's a dog's life, isn't it?\n\tWe'll see...   42 cats & 7 dogs  ",
    "a <think> tag, </think> and <|im_end|> inside",
    LONG,
]
SHORT_LEN = 48
TEMPLATES = {"klein": False, "zimage": True}  # enable_thinking as each pipeline passes it
# The tiny model's 4 layers stand for Qwen3-4B's 36: FLUX.2 [klein]'s hidden states
# (9, 18, 27) scaled to (1, 2, 3); Z-Image's -2 is layer 3's output either way.
KLEIN_LAYERS = (1, 2, 3)

CORPUS = """
a photo of a cat sitting on a mat. a painting of a dog in the park. a very detailed
painting of a small orange cat sitting on a red mat. the cat wears a hat. hello world.
a photograph of a mountain landscape at sunset, highly detailed, trending on artstation.
portrait of a woman with long hair, oil painting, soft light. a red car on a street at night.
it's a dog's life, isn't it? we'll see. they'd've liked the cats and the dogs. 42 cats.
café crème, naïve résumé, the school. tokyo at night, neon lights, rain on the street.
a bird on a branch, watercolor. an astronaut riding a horse on the moon, digital art.
close up photo of a flower with dew drops, macro, bokeh. a castle on a hill, fantasy art.
user assistant
""" * 3


def chat_prompt(caption, thinking):
    """FLAME's rendering (flame::encoders::chat_prompt), checked against the template."""
    s = f"<|im_start|>user\n{caption}<|im_end|>\n<|im_start|>assistant\n"
    return s if thinking else s + "<think>\n\n</think>\n\n"


def make_tokenizer():
    folder = os.path.join(OUT, "tokenizer")
    os.makedirs(folder)
    tok = tokenizers.Tokenizer(models.BPE(dropout=None, unk_token=None,
                                          continuing_subword_prefix="", end_of_word_suffix="",
                                          fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                              use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                     use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=320, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    tok.train_from_iterator(CORPUS.strip().split("\n"), trainer)
    # Qwen's added tokens after the vocabulary: the specials, then <think> / </think>
    # (special false, as in Qwen3's tokenizer.json).
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ["<think>", "</think>"]])
    path = os.path.join(folder, "tokenizer.json")
    tok.save(path)
    added = {}
    for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]:
        added[str(tok.token_to_id(t))] = {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": not t.endswith("think>")}
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": QWEN3_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return folder, tok


def make_tokens(folder, raw):
    hf = AutoTokenizer.from_pretrained(folder)
    assert type(hf).__name__ == "Qwen2Tokenizer", type(hf)
    out = {"vocab": len(hf), "pad_id": hf.pad_token_id, "templates": {}}
    for name, thinking in TEMPLATES.items():
        rows = []
        for caption in CAPTIONS:
            text = hf.apply_chat_template([{"role": "user", "content": caption}], tokenize=False,
                                          add_generation_prompt=True, enable_thinking=thinking)
            assert text == chat_prompt(caption, thinking), (text, caption)
            row = {"caption": caption, "text": text}
            lens = [SHORT_LEN] + ([512] if name == "klein" else [])
            for n in lens:
                enc = hf(text, padding="max_length", truncation=True, max_length=n)
                ids = enc["input_ids"]
                # transformers' Qwen2Tokenizer and the tokenizer.json agree.
                plain = raw.encode(text, add_special_tokens=False).ids
                assert ids[: len(plain)] == plain[:n], (caption, ids, plain)
                row[str(n)] = {"ids": ids, "mask": enc["attention_mask"]}
            rows.append(row)
        out["templates"][name] = {"thinking": thinking, "captions": rows}
    long_row = out["templates"]["klein"]["captions"][-1][str(SHORT_LEN)]
    assert all(long_row["mask"]), "the long caption must fill the 48 tokens"
    with open(os.path.join(OUT, "tokens.json"), "w") as f:
        json.dump(out, f, ensure_ascii=False)
    return hf


def randomize(model, seed):
    """Every parameter redrawn (norms and embeddings all matter), rounded to bf16 (what the
    fixture stores), in f64."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if "norm" in name:
                v = 1.0 + 0.2 * r
            elif "embed" in name:
                v = r
            else:
                v = r / p.shape[-1] ** 0.5
            p.copy_(v.to(torch.bfloat16).double())
    return model.double().eval()


def make_model(hf):
    cfg = Qwen3Config(vocab_size=len(hf), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=40960,
                      rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                      tie_word_embeddings=True, attention_bias=False,
                      pad_token_id=hf.pad_token_id, eos_token_id=hf.eos_token_id,
                      attn_implementation="eager")
    model = randomize(Qwen3ForCausalLM(cfg), 7)
    folder = os.path.join(OUT, "text_encoder")
    model.to(torch.bfloat16).save_pretrained(folder)
    for extra in os.listdir(folder):
        if extra not in ("config.json", "model.safetensors"):
            os.remove(os.path.join(folder, extra))
    # The reference runs the saved files as transformers loads them, in f64 (the model above
    # had its RoPE frequencies rounded to bf16 with its weights).
    model = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float64,
                                             attn_implementation="eager").eval()
    saved = safetensors.torch.load_file(os.path.join(folder, "model.safetensors"))
    assert "lm_head.weight" not in saved and "model.layers.0.self_attn.q_norm.weight" in saved
    assert all(k.startswith("model.") for k in saved)
    safetensors.torch.save_file(saved, os.path.join(OUT, "qwen_3_tiny.safetensors"))
    return model


def make_outputs(hf, model):
    io = {}
    prompts = [chat_prompt(c, TEMPLATES["klein"]) for c in CAPTIONS]
    enc = hf(prompts, padding="max_length", truncation=True, max_length=SHORT_LEN,
             return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    with torch.no_grad():
        hs = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        assert len(hs) == 5
        io["hidden.0"], io["hidden.4"] = hs[0], hs[4]
        io["unmasked.2"] = model(input_ids=ids, output_hidden_states=True).hidden_states[2]
    io["ids"], io["mask"] = ids, mask

    # The pipelines' own prompt encoding, around the tiny encoder and tokenizer (no
    # transformer, VAE or scheduler: the constructors take None), in f64.
    klein = Flux2KleinPipeline(scheduler=None, vae=None, text_encoder=model, tokenizer=hf,
                               transformer=None)
    with torch.no_grad():
        ctx, text_ids = klein.encode_prompt(prompt=CAPTIONS, device="cpu",
                                            max_sequence_length=SHORT_LEN,
                                            text_encoder_out_layers=KLEIN_LAYERS)
    assert ctx.dtype == torch.float64 and ctx.shape == (len(CAPTIONS), SHORT_LEN, 96)
    # Its features are hidden_states 1, 2, 3 side by side (the tests read them there).
    assert torch.equal(ctx, torch.cat([hs[i] for i in KLEIN_LAYERS], dim=2))
    io["klein.context"] = ctx
    io["klein.text_ids"] = text_ids.to(torch.float32)

    zimage = ZImagePipeline(scheduler=None, vae=None, text_encoder=model, tokenizer=hf,
                            transformer=None)
    with torch.no_grad():
        embeds, _ = zimage.encode_prompt(prompt=list(CAPTIONS), device="cpu",
                                         do_classifier_free_guidance=False,
                                         max_sequence_length=SHORT_LEN)
    zenc = hf([chat_prompt(c, TEMPLATES["zimage"]) for c in CAPTIONS], padding="max_length",
              truncation=True, max_length=SHORT_LEN, return_tensors="pt")
    io["zimage.ids"], io["zimage.mask"] = zenc["input_ids"], zenc["attention_mask"]
    for n, e in enumerate(embeds):
        assert e.dtype == torch.float64 and e.shape[0] == int(zenc["attention_mask"][n].sum())
        io[f"zimage.context.{n}"] = e

    arrays = {}
    for k, v in io.items():
        integer = not torch.is_floating_point(v)
        arrays[k] = v.to(torch.int64 if integer else torch.float32).numpy()
        if integer:
            arrays[k] = arrays[k].astype(np.uint32)
    from safetensors.numpy import save_file
    save_file(arrays, os.path.join(OUT, "outputs.safetensors"))


def make_keylist():
    # Qwen/Qwen3-4B config.json (the text encoder of FLUX.2 [klein] 4B and Z-Image).
    cfg = Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                      num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=40960,
                      rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                      tie_word_embeddings=True)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    keys = {k: list(v.shape) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    with open(os.path.join(OUT, "qwen3_4b_keys.json"), "w") as f:
        json.dump(keys, f, separators=(",", ":"), sort_keys=True)


if __name__ == "__main__":
    print("transformers", transformers.__version__, "diffusers", diffusers.__version__,
          "torch", torch.__version__, "tokenizers", tokenizers.__version__)
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    folder, raw = make_tokenizer()
    hf = make_tokens(folder, raw)
    model = make_model(hf)
    make_outputs(hf, model)
    make_keylist()
    total = 0
    for d, _, fs in sorted(os.walk(OUT)):
        for f in sorted(fs):
            p = os.path.join(d, f)
            total += os.path.getsize(p)
            digest = hashlib.sha256(open(p, "rb").read()).hexdigest()[:16]
            print(f"  {os.path.relpath(p, OUT)}: {os.path.getsize(p)} bytes, sha256 {digest}")
    print(f"wrote {OUT}: {total / 1024:.0f} KiB")
