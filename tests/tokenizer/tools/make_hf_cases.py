#!/usr/bin/env python3
"""Builds small tokenizers of the families rlhost must match (GPT-2, Llama-3, Qwen2, Llama-2
legacy, Llama-2/Mistral Metaspace, plus one that exercises the less common components) with
Hugging Face `tokenizers`, and writes <out>/<name>/tokenizer.json + cases.jsonl (text, flags,
ids, decoded). Needs `tokenizers` (runs on the device machine, which has it):

    python3 tests/tokenizer/tools/make_hf_cases.py <out-dir>

The committed copies live in tests/tokenizer/data/hf/; the fixture test checks every case.
"""
import json, os, random, sys

from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)

LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+")

rng = random.Random(1234)
WORDS = ("the of and to in is was for that with as on by at from this it be are or an which "
         "model token training reward policy gradient value batch sequence learning rate loss "
         "don't you'll WE'VE they'RE it's I'm we'd naïve café résumé Straße Ünïcödé ÀÉÎÕÜ ﬁ "
         "中文 字符 测试 日本語 テキスト 한국어 Привет мир Ελληνικά العربية हिन्दी").split()
CODE = ["def f(x):\n    return x**2  # comment\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
        "if __name__ == '__main__':\n    main()\n", "x = {'a': [1, 2.5, -3e10], \"b\": None}\n",
        "SELECT id, name FROM users WHERE age >= 21;\n", "<div class=\"x\">&amp;</div>\r\n"]
EMOJI = ["🤖", "🚀", "👩‍💻", "😀", "🙂", "🇫🇷", "👍🏽", "❤️"]


def corpus():
    out = []
    for _ in range(3000):
        n = rng.randint(3, 30)
        s = " ".join(rng.choice(WORDS) for _ in range(n))
        if rng.random() < 0.3:
            s += " " + str(rng.randint(0, 10**rng.randint(1, 9)))
        if rng.random() < 0.2:
            s += rng.choice(EMOJI)
        if rng.random() < 0.2:
            s += "\n" + rng.choice(CODE)
        out.append(s)
    return out


def texts(specials):
    base = [
        "Hello, world!", "  leading spaces and   runs   ", "numbers 1234567 and 3.14159, 42nd",
        "don't you'll WE'VE they'RE I'M", "naïve café — résumé", "中文字符测试，还有标点。",
        "emoji 🤖🚀 and ZWJ 👩‍💻 flags 🇫🇷", "tabs\tand\nnewlines\r\n\n\nend", "", " ", "  ", "\n", "\n\n \n",
        "a" * 300, "ab" * 200 + " " + "x" * 1000, "Mixed12abc34 5 678 9012",
        "\u00a0non-breaking\u2009thin\u3000ideographic\u200bzero-width",
        "ﬁ ﬂ ① ㎏ Å Å", "İstanbul ΣΑΣ ß", "x\u0301 e\u0301 combining", "\x00\x01 control \x7f chars",
        "<0x41> literal byte token text", "▁already▁has▁metaspace", "trailing space ", "-", "'s", "''''",
    ]
    for sp in specials:
        base += [sp, f"{sp}hi{sp}", f"hi {sp} there", f"  {sp}  x", f"word{sp}word", f"{sp}{sp}", f"a\n{sp}\nb",
                 f"{sp.lower()} {sp.upper()}"]
    frags = [" ", "  ", "\n", "\t", "the", "cat", "123", "4567", "'s", "'ll", "é", "ñ", "Σ", "中", "🙂", "!!", "??",
             "-", "_", "x", "α", "β"] + specials
    for _ in range(60):
        base.append("".join(rng.choice(frags) + (" " if rng.random() < 0.4 else "") for _ in range(rng.randint(1, 25))))
    return base


def train_bpe(tok, vocab_size, specials, alphabet=None, **kw):
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=alphabet or [], **kw)
    tok.train_from_iterator(corpus(), trainer)
    return tok


def with_byte_tokens(tok):
    """Adds <0x00>..<0xFF> to the vocabulary and turns byte_fallback on (Llama-2 layout)."""
    d = json.loads(tok.to_str())
    vocab = d["model"]["vocab"]
    # Byte tokens go right after the special tokens, as in Llama-2, shifting the rest.
    n_special = len(d["added_tokens"])
    items = sorted(vocab.items(), key=lambda kv: kv[1])
    head, tail = items[:n_special], items[n_special:]
    new = [k for k, _ in head] + [f"<0x{b:02X}>" for b in range(256)] + [k for k, _ in tail if not (k.startswith("<0x") and len(k) == 6)]
    d["model"]["vocab"] = {k: i for i, k in enumerate(new)}
    d["model"]["byte_fallback"] = True
    for t in d["added_tokens"]:
        t["id"] = d["model"]["vocab"][t["content"]]
    return Tokenizer.from_str(json.dumps(d))


def build():
    out = {}

    # GPT-2: ByteLevel pre-tokenizer with its built-in regex.
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.post_processor = processors.ByteLevel(trim_offsets=True)
    train_bpe(t, 900, [], pre_tokenizers.ByteLevel.alphabet())
    t.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=True)])
    out["gpt2"] = (t, ["<|endoftext|>"])

    # Llama-3: Split regex + ByteLevel(use_regex=False), ignore_merges, BOS template.
    t = Tokenizer(models.BPE(ignore_merges=True))
    t.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_RE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    t.decoder = decoders.ByteLevel()
    sp = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    train_bpe(t, 1000, sp, pre_tokenizers.ByteLevel.alphabet())
    t.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", t.token_to_id("<|begin_of_text|>"))])])
    out["llama3"] = (t, sp)

    # Qwen2: NFC + Split (single digits) + ByteLevel; special and non-special added tokens.
    t = Tokenizer(models.BPE())
    t.normalizer = normalizers.NFC()
    t.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_RE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    t.decoder = decoders.ByteLevel()
    t.post_processor = processors.ByteLevel(trim_offsets=False)
    sp = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    train_bpe(t, 1000, sp, pre_tokenizers.ByteLevel.alphabet())
    t.add_tokens([AddedToken("<tool_call>", special=False, normalized=False),
                  AddedToken("</tool_call>", special=False, normalized=False)])
    out["qwen2"] = (t, sp + ["<tool_call>", "</tool_call>"])

    # Llama-2 (legacy): Prepend/Replace normalizer, byte fallback, decoder chain, <s> template.
    t = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(content=" ", left=1, right=0)])
    sp = ["<unk>", "<s>", "</s>"]
    train_bpe(t, 900, sp)
    t = with_byte_tokens(t)
    t.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B:1",
                                                     special_tokens=[("<s>", t.token_to_id("<s>"))])
    out["llama2"] = (t, sp)

    # Mistral / Llama-2 non-legacy: Metaspace(prepend_scheme=first, split=False), <s> $A </s>?
    t = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(content=" ", left=1, right=0)])
    sp = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
    train_bpe(t, 900, sp)
    t = with_byte_tokens(t)
    t.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B:1",
                                                     special_tokens=[("<s>", t.token_to_id("<s>"))])
    out["mistral"] = (t, sp)

    # Metaspace with split=True and the Metaspace decoder.
    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    t.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    sp = ["<unk>", "<pad>"]
    train_bpe(t, 700, sp)
    out["metaspace_split"] = (t, sp)

    # Less common components: NFKC + Lowercase + Strip + Replace(regex), Whitespace / Punctuation /
    # Digits, continuing_subword_prefix / end_of_word_suffix, BPE decoder, Bert-style wrapping, and
    # added tokens with lstrip / rstrip / single_word / normalized.
    t = Tokenizer(models.BPE(unk_token="[UNK]", continuing_subword_prefix="##", end_of_word_suffix="</w>"))
    t.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase(),
                                         normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip()])
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation(behavior="isolated"),
                                               pre_tokenizers.Digits(individual_digits=True)])
    t.decoder = decoders.BPEDecoder(suffix="</w>")
    sp = ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    train_bpe(t, 900, sp, continuing_subword_prefix="##", end_of_word_suffix="</w>")
    t.post_processor = processors.BertProcessing(("[SEP]", t.token_to_id("[SEP]")), ("[CLS]", t.token_to_id("[CLS]")))
    t.add_special_tokens([AddedToken("[MASK]", lstrip=True, rstrip=False, special=True, normalized=False)])
    t.add_tokens([AddedToken("<sep>", rstrip=True, normalized=False),
                  AddedToken("cat", single_word=True, normalized=True),
                  AddedToken("Hello World", normalized=True)])
    out["misc"] = (t, ["[MASK]", "<sep>", "cat", "Hello World", "[CLS]"])

    # Split behaviors and invert on a plain char-level BPE.
    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\d+"), behavior="merged_with_previous"),
        pre_tokenizers.Split(" ", behavior="merged_with_next"),
        pre_tokenizers.Split(Regex(r"[,.;]"), behavior="contiguous"),
        pre_tokenizers.Split(Regex(r"[a-z]+"), behavior="removed", invert=True),
        pre_tokenizers.WhitespaceSplit()])
    t.decoder = decoders.Fuse()
    train_bpe(t, 600, ["<unk>"])
    out["split_behaviors"] = (t, ["<unk>"])
    return out


def main():
    dst = sys.argv[1]
    for name, (tok, specials) in build().items():
        d = os.path.join(dst, name)
        os.makedirs(d, exist_ok=True)
        # Round-trip through JSON so the cases come from exactly the file we ship.
        s = tok.to_str()
        tok = Tokenizer.from_str(s)
        with open(os.path.join(d, "tokenizer.json"), "w") as f:
            f.write(s)
        n = 0
        with open(os.path.join(d, "cases.jsonl"), "w") as f:
            for text in texts(specials):
                for add in (True, False):
                    ids = tok.encode(text, add_special_tokens=add).ids
                    for skip in (False, True):
                        f.write(json.dumps({"text": text, "add_special_tokens": add, "ids": ids,
                                            "skip_special_tokens": skip,
                                            "decoded": tok.decode(ids, skip_special_tokens=skip)},
                                           ensure_ascii=False) + "\n")
                        n += 1
        print(name, n, "cases", len(s), "bytes")


if __name__ == "__main__":
    main()
