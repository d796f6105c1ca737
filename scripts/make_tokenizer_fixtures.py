#!/usr/bin/env python3
"""Fixtures for tests/tokenizer_vocab.rs: what transformers returns for hard captions with the
tokenizers FLAME ships (vocab/, written by scripts/make_vocab.py) and with bare spiece.model
files.

Writes tests/fixtures/tokenizers/:
  ids.json            per tokenizer: max_len, the pad id and, for every caption, input_ids
                      up to the padding (attention_mask is 1 over them, 0 over the padding)
                      as the pipelines call the tokenizer
                      (padding="max_length", truncation=True, max_length=max_len):
                        clip_l       CLIPTokenizer from vocab.json + merges.txt with CLIP-L's
                                     tokenizer_config.json (pads with <|endoftext|>), 77
                        clip_g       the same with bigG's (SDXL / SD3 tokenizer_2: pads with "!")
                        t5_256, t5_512      T5TokenizerFast from the shipped tokenizer.json
                        t5_spiece_256       T5TokenizerFast converted from T5's spiece.model
                                            (t5_spiece.model.gz, written by make_vocab.py);
                                            checked here equal to t5_256
                        small_spiece_64     T5TokenizerFast converted from small_spiece.model.gz
                        qwen3_raw_64        Qwen2TokenizerFast (tokenizer.json +
                                            tokenizer_config.json) on the caption as it is
                        qwen3_klein_512     on the chat template's prompt, enable_thinking=False
                                            (FLUX.2 [klein], diffusers Flux2KleinPipeline)
                        qwen3_zimage_512    enable_thinking=True (Z-Image, ZImagePipeline)
  small_spiece.model.gz  a unigram model trained here with sentencepiece (nmt_nfkc, T5's special
                      ids: pad 0, </s> 1, <unk> 2, no <s>)

Deterministic (one thread, fixed corpus). Run: python3 scripts/make_tokenizer_fixtures.py
Made with transformers 5.24.0, tokenizers 0.23.3, sentencepiece 0.2 and protobuf (PyPI).
"""

import gzip
import io
import json
import os
import shutil
import tempfile

import sentencepiece as spm
from transformers import CLIPTokenizer, Qwen2TokenizerFast, T5TokenizerFast

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
VOCAB = os.path.join(ROOT, "vocab")
OUT = os.path.join(ROOT, "tests", "fixtures", "tokenizers")

LONG = ", ".join(
    [
        "a breathtaking panoramic photograph of snow-capped mountains at golden hour",
        "mist rolling through a pine forest in the valley below",
        "a wooden cabin with warm light in the windows",
        "highly detailed, 8k, sharp focus, volumetric lighting, award-winning composition",
    ]
    * 6
)

CAPTIONS = [
    "",
    "a photo of a cat",
    "A PHOTO Of A Cat",
    "  leading and trailing spaces   ",
    "multiple     spaces\tand\t\ttabs",
    "line one\nline two\r\nline three\n\n\nafter blank lines",
    "café crème brûlée, naïve résumé, Ångström, Øresund, São Paulo, Zürich",
    "Ｆｕｌｌｗｉｄｔｈ ＡＢＣ １２３ ①②③ ﬁ ﬂ ㎏ ™ ½",
    "日本語のキャプション、東京の夜景。中文标题：猫在桌子上。한국어 캡션",
    "a cat 🐱 wearing a hat 🎩, 👍🏽 👨‍👩‍👧‍👦 🇯🇵 ❤️ ✨",
    "Привет мир, Γειά σου κόσμε, مرحبا بالعالم, שלום עולם, नमस्ते दुनिया",
    "(masterpiece:1.2), ((best quality)), [blurry:0.5], {red|blue} hair, <lora:style:0.8>",
    "wow!!! really??? ... --- ___ *** ### $$$ %%% &&& @@@ ~~~ ``` ''' \"\"\"",
    "!!!! hello!! !",
    "3.14159 1,000,000 42nd 2024-11-29 12:30pm 0x1F $19.99 -7 1e10 v1.5",
    "it's a dog's life, isn't it? we'll see; they'd've LIKED it",
    "special text: <|endoftext|> <|startoftext|> </s> <pad> <unk> <extra_id_0> <|im_start|> <think>",
    "tabs\tand\u00a0non-breaking\u2009thin\u200bzero-width spaces",
    LONG,
]


def encode_all(tok, max_len, texts=None):
    """Each caption's ids up to the padding: the mask is 1 over them and 0 after, where every
    id is the pad id (checked here), so the test rebuilds both."""
    out = []
    for c, t in zip(CAPTIONS, texts or CAPTIONS):
        e = tok(t, padding="max_length", max_length=max_len, truncation=True)
        ids, mask = e["input_ids"], e["attention_mask"]
        n = sum(mask)
        assert len(ids) == max_len and mask == [1] * n + [0] * (max_len - n), c
        assert all(i == tok.pad_token_id for i in ids[n:]), c
        out.append({"text": c, "ids": ids[:n]})
    return {"max_len": max_len, "pad": tok.pad_token_id, "captions": out}


def unpack(tmp, name, out_name=None):
    src = os.path.join(VOCAB, name)
    dst = os.path.join(tmp, out_name or name.removesuffix(".gz"))
    if name.endswith(".gz"):
        with gzip.open(src, "rb") as f, open(dst, "wb") as g:
            g.write(f.read())
    else:
        shutil.copy(src, dst)
    return dst


def clip(tmp, which):
    folder = os.path.join(tmp, which)
    os.makedirs(folder)
    unpack(folder, "clip_vocab.json.gz", "vocab.json")
    unpack(folder, "clip_merges.txt.gz", "merges.txt")
    unpack(folder, f"{which}_tokenizer_config.json", "tokenizer_config.json")
    tok = CLIPTokenizer.from_pretrained(folder)
    assert tok.pad_token == {"clip_l": "<|endoftext|>", "clip_g": "!"}[which]
    assert len(tok) == 49408
    return encode_all(tok, 77)


def small_spiece():
    """A unigram model with T5's special ids, trained on the captions and a little more."""
    lines = [c for c in CAPTIONS if c.strip()] * 3
    lines += ["a photograph of a mountain landscape at sunset", "portrait of a woman, oil"]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=300,
        hard_vocab_limit=False,
        model_type="unigram",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        normalization_rule_name="nmt_nfkc",
        character_coverage=0.98,
        num_threads=1,
        minloglevel=2,
    )
    return model.getvalue()


def t5_from_spiece(tmp, data, name):
    folder = os.path.join(tmp, name)
    os.makedirs(folder)
    with open(os.path.join(folder, "spiece.model"), "wb") as f:
        f.write(data)
    tok = T5TokenizerFast.from_pretrained(folder)
    return tok


def main():
    os.makedirs(OUT, exist_ok=True)
    fixtures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for which in ["clip_l", "clip_g"]:
            fixtures[which] = clip(tmp, which)

        t5_dir = os.path.join(tmp, "t5")
        os.makedirs(t5_dir)
        unpack(t5_dir, "t5_tokenizer.json.gz", "tokenizer.json")
        t5 = T5TokenizerFast.from_pretrained(t5_dir)
        assert len(t5) == 32100 and t5.eos_token_id == 1 and t5.pad_token_id == 0
        for n in [256, 512]:
            fixtures[f"t5_{n}"] = encode_all(t5, n)

        with gzip.open(os.path.join(OUT, "t5_spiece.model.gz"), "rb") as f:
            real = t5_from_spiece(tmp, f.read(), "t5_spiece")
        fixtures["t5_spiece_256"] = encode_all(real, 256)
        assert fixtures["t5_spiece_256"] == fixtures["t5_256"], "spiece.model and tokenizer.json differ"

        data = small_spiece()
        with gzip.GzipFile(os.path.join(OUT, "small_spiece.model.gz"), "wb", mtime=0) as f:
            f.write(data)
        fixtures["small_spiece_64"] = encode_all(t5_from_spiece(tmp, data, "small"), 64)

        q_dir = os.path.join(tmp, "qwen3")
        os.makedirs(q_dir)
        unpack(q_dir, "qwen3_tokenizer.json.gz", "tokenizer.json")
        unpack(q_dir, "qwen3_tokenizer_config.json.gz", "tokenizer_config.json")
        qwen = Qwen2TokenizerFast.from_pretrained(q_dir)
        assert qwen.pad_token_id == 151643 and qwen.convert_tokens_to_ids("</think>") == 151668
        fixtures["qwen3_raw_64"] = encode_all(qwen, 64)
        for name, thinking in [("qwen3_klein_512", False), ("qwen3_zimage_512", True)]:
            prompts = [
                qwen.apply_chat_template(
                    [{"role": "user", "content": c}],
                    tokenize=False,
                    add_generation_prompt=True,
                    enable_thinking=thinking,
                )
                for c in CAPTIONS
            ]
            fixtures[name] = encode_all(qwen, 512, prompts)

    with open(os.path.join(OUT, "ids.json"), "w", encoding="utf-8") as f:
        json.dump(fixtures, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    for k, v in fixtures.items():
        real = [len(c["ids"]) for c in v["captions"]]
        print(f"{k}: max_len {v['max_len']}, tokens {min(real)}..{max(real)}")


if __name__ == "__main__":
    main()
