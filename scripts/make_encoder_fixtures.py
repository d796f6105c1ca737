#!/usr/bin/env python3
"""Fixtures for tests/encoders.rs: tiny tokenizers and tiny random text encoders, with what
transformers returns for them.

Writes tests/fixtures/encoders/:
  clip_tokenizer/       vocab.json + merges.txt (a CLIP-style byte-level BPE learned here from
                        a small corpus; OpenAI's vocabulary cannot be downloaded here) and the
                        config files of CLIP-L's tokenizer/ (pads with <|endoftext|>)
  clip_tokenizer_2/     the same vocabulary with the config files of SDXL's bigG tokenizer_2/
                        (pad_token "!", id 0)
  clip_tokenizer_json/  the same as one tokenizer.json, saved by transformers
  t5_tokenizer/         tokenizer.json of a unigram model trained here with sentencepiece
                        (nmt_nfkc normalization, pad 0, </s> 1, <unk> 2, as T5's)
  tokens.json           transformers' input_ids and attention_mask for every caption
  clip_l/, clip_g/, t5/ config.json + model.safetensors (transformers layout, f32, keys as
                        transformers 5 saves them: clip_l's without "text_model.")
  sdxl_te.safetensors   clip_l under conditioner.embedders.0.transformer. and clip_g in
                        OpenCLIP's layout under conditioner.embedders.1.model. (as SDXL's file)
  sd3_te.safetensors    t5 under text_encoders.t5xxl.transformer. (as in SD3.5's all-in-one
                        files)
  outputs.safetensors   inputs and transformers' outputs (computed in f64, stored in f32)

Deterministic (fixed seeds, one thread). Run: python3 scripts/make_encoder_fixtures.py
Made with torch 2.15.0, transformers 5.24.0, tokenizers 0.23.3, sentencepiece (PyPI).
"""

import io
import json
import os
import re
import shutil
import tempfile
from collections import Counter

import numpy as np
import sentencepiece as spm
import torch
import transformers
from safetensors.numpy import save_file
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

torch.set_num_threads(1)
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "tests", "fixtures", "encoders")

# ---------------------------------------------------------------------------------------------
# Captions the tokenizer tests encode: empty, case and whitespace, accents, CJK, emoji,
# punctuation, prompt-weight syntax kept as text, contractions, and one longer than 77 tokens.
CAPTIONS = [
    "",
    "a photo of a cat",
    "  A PHOTO   of a\tCat\n on a   mat  ",
    "café crème, naïve résumé à l'école",
    "日本語のキャプション、東京の夜",
    "a cat 🐱 wearing a hat 🎩 and 👍🏽",
    "Hello, world!!! (cat:1.2) [dog] {bird} <lora:style:0.8> a|b \"quoted\" 3.14 #tag @user",
    "it's a dog's life, isn't it? we'll see; they'd've 42 cats & 7 dogs",
    "ｆｕｌｌｗｉｄｔｈ ＡＢＣ ①②③ ﬁ",
    " ".join(["a very detailed painting of a small orange cat sitting on a red mat"] * 8),
]

# Text the tiny vocabularies are learned from.
CORPUS = """
a photo of a cat sitting on a mat. a painting of a dog in the park. a very detailed
painting of a small orange cat sitting on a red mat. the cat wears a hat. hello world.
a photograph of a mountain landscape at sunset, highly detailed, trending on artstation.
portrait of a woman with long hair, oil painting, soft light. a red car on a street at night.
it's a dog's life, isn't it? we'll see. they'd've liked the cats and the dogs.
café crème, naïve résumé, the school. tokyo at night, neon lights, rain on the street.
a bird on a branch, watercolor. an astronaut riding a horse on the moon, digital art.
close up photo of a flower with dew drops, macro, bokeh. a castle on a hill, fantasy art.
""" * 3


# ---------------------------------------------------------------------------------------------
# CLIP byte-level BPE, built as OpenAI's SimpleTokenizer builds its vocabulary: the 256 byte
# symbols, the same with "</w>", one entry per merge, then <|startoftext|> and <|endoftext|>.
def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def learn_merges(text, count):
    b2u = bytes_to_unicode()
    words = Counter(re.findall(r"[^\W\d_]+|\d|[^\s\w]+", text.lower()))
    seqs = {}
    for w, c in words.items():
        sym = [b2u[b] for b in w.encode("utf-8")]
        sym[-1] += "</w>"
        seqs[tuple(sym)] = seqs.get(tuple(sym), 0) + c
    merges = []
    for _ in range(count):
        pairs = Counter()
        for s, c in seqs.items():
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        new = {}
        for s, c in seqs.items():
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(s[i] + s[i + 1])
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            new[tuple(out)] = new.get(tuple(out), 0) + c
        seqs = new
    return merges


def write_clip_vocab(folder, merges):
    os.makedirs(folder, exist_ok=True)
    base = list(bytes_to_unicode().values())
    vocab = base + [v + "</w>" for v in base] + ["".join(m) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    assert len(set(vocab)) == len(vocab)
    with open(os.path.join(folder, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump({v: i for i, v in enumerate(vocab)}, f, ensure_ascii=False)
    with open(os.path.join(folder, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return len(vocab)


def special(content, normalized):
    return {
        "content": content,
        "lstrip": False,
        "normalized": normalized,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


def write_clip_configs(folder, n_vocab, pad):
    """tokenizer_config.json and special_tokens_map.json as in diffusers pipelines (CLIP-L's
    tokenizer/ pads with <|endoftext|>, SDXL's tokenizer_2/ with "!")."""
    bos, eos = n_vocab - 2, n_vocab - 1
    added = {str(bos): special("<|startoftext|>", True), str(eos): special("<|endoftext|>", True)}
    if pad == "!":
        added = {"0": special("!", False), **added}
    cfg = {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": "<|startoftext|>",
        "clean_up_tokenization_spaces": True,
        "do_lower_case": True,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "model_max_length": 77,
        "pad_token": pad,
        "tokenizer_class": "CLIPTokenizer",
        "unk_token": "<|endoftext|>",
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    stm = {
        "bos_token": special("<|startoftext|>", True),
        "eos_token": special("<|endoftext|>", True),
        "pad_token": pad if pad == "!" else special(pad, True),
        "unk_token": special("<|endoftext|>", True),
    }
    with open(os.path.join(folder, "special_tokens_map.json"), "w") as f:
        json.dump(stm, f, indent=2)


def encode_all(tok, max_len):
    out = []
    for c in CAPTIONS:
        e = tok(c, padding="max_length", max_length=max_len, truncation=True)
        out.append({"text": c, "ids": e["input_ids"], "mask": e["attention_mask"]})
    return out


def make_tokenizers():
    tokens = {}
    merges = learn_merges(CORPUS, 300)
    for name, pad in [("clip_tokenizer", "<|endoftext|>"), ("clip_tokenizer_2", "!")]:
        folder = os.path.join(OUT, name)
        n_vocab = write_clip_vocab(folder, merges)
        write_clip_configs(folder, n_vocab, pad)
        tok = CLIPTokenizer.from_pretrained(folder)
        assert tok.pad_token == pad, (tok.pad_token, pad)
        tokens[name] = {"max_len": 77, "captions": encode_all(tok, 77)}
        if name == "clip_tokenizer":
            jfolder = os.path.join(OUT, "clip_tokenizer_json")
            with tempfile.TemporaryDirectory() as tmp:
                tok.save_pretrained(tmp)
                os.makedirs(jfolder, exist_ok=True)
                shutil.copy(os.path.join(tmp, "tokenizer.json"), jfolder)
            jtok = CLIPTokenizer(tokenizer_file=os.path.join(jfolder, "tokenizer.json"))
            tokens["clip_tokenizer_json"] = {"max_len": 77, "captions": encode_all(jtok, 77)}
            assert tokens["clip_tokenizer_json"] == tokens["clip_tokenizer"]

    # T5: a unigram model learned with sentencepiece (T5's special ids), converted and saved
    # by transformers as the tokenizer.json that diffusers pipelines ship.
    lines = [l.strip() for l in re.split(r"[.\n]", CORPUS) if l.strip()]
    lines += ["日本語のキャプション", "東京の夜", "ｆｕｌｌｗｉｄｔｈ ＡＢＣ"]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=120,
        hard_vocab_limit=False,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        normalization_rule_name="nmt_nfkc",
        character_coverage=0.995,
        num_threads=1,
        minloglevel=2,
    )
    t5dir = os.path.join(OUT, "t5_tokenizer")
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "spiece.model"), "wb") as f:
            f.write(model.getvalue())
        tok = T5Tokenizer.from_pretrained(tmp, extra_ids=4)
        out = os.path.join(tmp, "out")
        tok.save_pretrained(out)
        os.makedirs(t5dir, exist_ok=True)
        shutil.copy(os.path.join(out, "tokenizer.json"), t5dir)
    t5 = T5Tokenizer(tokenizer_file=os.path.join(t5dir, "tokenizer.json"))
    for n in [16, 256]:
        tokens[f"t5_tokenizer_{n}"] = {"max_len": n, "captions": encode_all(t5, n)}
    with open(os.path.join(OUT, "tokens.json"), "w", encoding="utf-8") as f:
        json.dump(tokens, f, ensure_ascii=False, indent=0)


# ---------------------------------------------------------------------------------------------
# Tiny models: every parameter redrawn (so norms, biases and embeddings all matter), rounded
# to f32 (what the fixture stores), and run in f64.
def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if "norm" in name and name.endswith("weight"):
                v = 1.0 + 0.2 * r
            elif name.endswith("bias") and "relative_attention_bias" not in name:
                v = 0.2 * r
            elif "embed" in name or "relative_attention_bias" in name:
                v = r
            else:
                v = r / p.shape[-1] ** 0.5
            p.copy_(v.float().double())
    return model.double().eval()


def f32(sd):
    return {k: v.detach().float().contiguous().numpy() for k, v in sd.items()}


def save_model(folder, model):
    os.makedirs(folder, exist_ok=True)
    model.config.to_json_file(os.path.join(folder, "config.json"))
    sd = {k: v for k, v in model.state_dict().items() if k != "encoder.embed_tokens.weight"}
    save_file(f32(sd), os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return sd


def open_clip_keys(sd):
    """transformers CLIP keys -> OpenCLIP's (SDXL single file's bigG)."""
    out = {}
    n = 1 + max(int(k.split(".")[3]) for k in sd if k.startswith("text_model.encoder.layers."))
    out["token_embedding.weight"] = sd["text_model.embeddings.token_embedding.weight"]
    out["positional_embedding"] = sd["text_model.embeddings.position_embedding.weight"]
    for i in range(n):
        t, o = f"text_model.encoder.layers.{i}.", f"transformer.resblocks.{i}."
        for leaf in ["weight", "bias"]:
            out[o + "attn.in_proj_" + leaf] = torch.cat(
                [sd[f"{t}self_attn.{p}_proj.{leaf}"] for p in "qkv"], 0
            )
            for a, b in [("self_attn.out_proj", "attn.out_proj"), ("layer_norm1", "ln_1"),
                         ("layer_norm2", "ln_2"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")]:
                out[f"{o}{b}.{leaf}"] = sd[f"{t}{a}.{leaf}"]
    out["ln_final.weight"] = sd["text_model.final_layer_norm.weight"]
    out["ln_final.bias"] = sd["text_model.final_layer_norm.bias"]
    out["text_projection"] = sd["text_projection.weight"].t()
    return out


def ids_rows(vocab, lens, length, bos, eos, pad, seed):
    g = torch.Generator().manual_seed(seed)
    rows, masks = [], []
    for n in lens:
        body = torch.randint(0, vocab - 2, (n,), generator=g).tolist()
        row = ([bos] if bos is not None else []) + body + [eos]
        masks.append([1] * len(row) + [0] * (length - len(row)))
        rows.append(row + [pad] * (length - len(row)))
    return torch.tensor(rows), torch.tensor(masks)


def make_models():
    io_out = {}
    V = 100
    # CLIP-L-like: quick GELU, the legacy eos_token_id 2 (pooled at the largest id, EOS = V-1),
    # padded with EOS. bigG-like: GELU, a projection, eos_token_id = EOS = V-2 (pooled at the
    # first EOS) below BOS = V-1 (so the legacy rule would pick BOS), padded with 0.
    common = dict(vocab_size=V, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=2, max_position_embeddings=77, layer_norm_eps=1e-5,
                  bos_token_id=V - 2, pad_token_id=1, attn_implementation="eager")
    cfg_l = CLIPTextConfig(hidden_act="quick_gelu", eos_token_id=2, **common)
    cfg_g = CLIPTextConfig(hidden_act="gelu", eos_token_id=V - 2, projection_dim=16, **common)
    clip_l = randomize(CLIPTextModel(cfg_l), 1)
    clip_g = randomize(CLIPTextModelWithProjection(cfg_g), 2)
    sd_l = save_model(os.path.join(OUT, "clip_l"), clip_l)
    sd_g = save_model(os.path.join(OUT, "clip_g"), clip_g)
    for name, model, bos, eos, pad in [("clip_l", clip_l, V - 2, V - 1, V - 1),
                                       ("clip_g", clip_g, V - 1, V - 2, 0)]:
        ids, mask = ids_rows(V, [9, 40], 48, bos, eos, pad, 3)
        with torch.no_grad():
            o = model(input_ids=ids, output_hidden_states=True)
        io_out[f"{name}.ids"] = ids.numpy().astype(np.uint32)
        io_out[f"{name}.mask"] = mask.numpy().astype(np.uint32)
        io_out[f"{name}.last_hidden"] = o.last_hidden_state
        io_out[f"{name}.penultimate"] = o.hidden_states[-2]
        if name == "clip_l":
            with torch.no_grad():
                om = model(input_ids=ids, attention_mask=mask)
            io_out[f"{name}.last_hidden_masked"] = om.last_hidden_state
            io_out[f"{name}.pooled"] = o.pooler_output
        else:
            # CLIPTextModelWithProjection returns text_embeds; pooled is its input.
            tm = model.text_model(input_ids=ids)
            io_out[f"{name}.pooled"] = tm.pooler_output
            io_out[f"{name}.projected"] = o.text_embeds

    # T5 v1.1-like encoder: gated GELU, 32 buckets up to distance 128; 140 tokens so every
    # bucket is used (distances past 128 share the last).
    cfg_t5 = T5Config(vocab_size=V, d_model=24, d_kv=6, d_ff=32, num_layers=2, num_heads=4,
                      relative_attention_num_buckets=32, relative_attention_max_distance=128,
                      feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6,
                      is_encoder_decoder=False, use_cache=False, attn_implementation="eager")
    t5 = randomize(T5EncoderModel(cfg_t5), 4)
    sd_t5 = save_model(os.path.join(OUT, "t5"), t5)
    ids, mask = ids_rows(V, [20, 130], 140, None, 1, 0, 5)
    with torch.no_grad():
        io_out["t5.last_hidden"] = t5(input_ids=ids).last_hidden_state
        io_out["t5.last_hidden_masked"] = t5(input_ids=ids, attention_mask=mask).last_hidden_state
    # transformers' bucket of every relative position in [-300, 300] (32 buckets, 128).
    rel = torch.arange(-300, 301)
    io_out["t5.buckets"] = t5.encoder.block[0].layer[0].SelfAttention._relative_position_bucket(
        rel, bidirectional=True, num_buckets=32, max_distance=128).numpy().astype(np.uint32)
    io_out["t5.ids"] = ids.numpy().astype(np.uint32)
    io_out["t5.mask"] = mask.numpy().astype(np.uint32)

    # transformers 5 saves a CLIPTextModel without "text_model." (clip_l/ is such a file);
    # SDXL's file, like diffusers' text_encoder/ folders, has it.
    sdxl = {f"conditioner.embedders.0.transformer.text_model.{k}": v for k, v in sd_l.items()}
    sdxl.update({f"conditioner.embedders.1.model.{k}": v
                 for k, v in open_clip_keys(sd_g).items()})
    save_file(f32(sdxl), os.path.join(OUT, "sdxl_te.safetensors"))
    sd3 = {f"text_encoders.t5xxl.transformer.{k}": v for k, v in sd_t5.items()}
    save_file(f32(sd3), os.path.join(OUT, "sd3_te.safetensors"))

    arrays = {k: (v if isinstance(v, np.ndarray) else v.detach().float().contiguous().numpy())
              for k, v in io_out.items()}
    save_file(arrays, os.path.join(OUT, "outputs.safetensors"))


if __name__ == "__main__":
    print("transformers", transformers.__version__, "torch", torch.__version__)
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    make_tokenizers()
    make_models()
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(OUT) for f in fs)
    print(f"wrote {OUT}: {total / 1024:.0f} KiB")
