import gzip
import json

from olmo_ds.data.prepare.sample_corpus import write_sample_corpus


def test_sample_corpus_is_real_text_and_deterministic(tmp_path):
    a = write_sample_corpus(tmp_path / "a", max_bytes=400_000)
    b = write_sample_corpus(tmp_path / "b", max_bytes=400_000)
    assert a == b
    assert (tmp_path / "a" / "prose.jsonl").read_bytes() == (tmp_path / "b" / "prose.jsonl").read_bytes()
    docs = [json.loads(line)["text"] for line in open(tmp_path / "a" / "prose.jsonl")]
    code = [json.loads(line)["text"] for line in gzip.open(tmp_path / "a" / "code.jsonl.gz", "rt")]
    assert len(docs) > 50 and all(len(d) >= 80 for d in docs)
    assert any("def " in c for c in code)
    assert sum(len(d.encode()) for d in docs) >= 200_000
