"""The command line: clear one-line errors, model listing, ask over documents."""

from __future__ import annotations

import json

from kvblend.cli import main


def test_missing_gguf_is_one_clear_line(capsys) -> None:
    assert main(["generate", "--model", "/nowhere/model.gguf", "hi"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_unknown_model_name_lists_the_known_ones(capsys) -> None:
    assert main(["generate", "--model", "gpt-17", "hi"]) == 2
    assert "smollm2-135m" in capsys.readouterr().err


def test_models_lists_packaged_models(capsys) -> None:
    assert main(["models"]) == 0
    assert "smollm2-135m" in capsys.readouterr().out


def test_ask_missing_document_is_a_clear_error(capsys, tmp_path) -> None:
    assert main(["ask", "--doc", str(tmp_path / "nope.txt"), "why?"]) == 2
    assert "cannot read document" in capsys.readouterr().err


def test_ask_answers_with_json_stats(capsys, tmp_path, smollm2) -> None:
    doc = tmp_path / "a.txt"
    doc.write_text("The Eiffel Tower is in Paris. It was finished in 1889.")
    assert main(["ask", "--doc", str(doc), "Where is the Eiffel Tower?", "--max-tokens", "8", "--json",
                 "--store-dir", str(tmp_path / "kv")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["method"] == "blend" and len(out["stats"]["docs"]) == 1
    assert list((tmp_path / "kv").rglob("*.safetensors"))  # the miss was written back to disk


def test_generate_reads_the_prompt_from_stdin(capsys, monkeypatch, smollm2) -> None:
    import io

    import kvblend.cli

    monkeypatch.setattr(kvblend.cli, "_load", lambda args: smollm2)
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?"))
    assert main(["generate", "--chat", "--max-tokens", "12"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_ask_with_a_non_utf8_document_names_the_file(capsys, tmp_path) -> None:
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café au lait".encode("latin-1"))
    assert main(["ask", "--doc", str(bad), "why?"]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "UTF-8" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_unexpected_errors_are_one_line_with_a_failing_exit_code(capsys, monkeypatch) -> None:
    import kvblend.cli as cli

    def broken(args):
        raise RuntimeError("the allocator gave up")

    monkeypatch.delenv("KVBLEND_DEBUG", raising=False)
    monkeypatch.setattr(cli, "cmd_models", broken)
    assert main(["models"]) == 1
    err = capsys.readouterr().err
    assert "RuntimeError: the allocator gave up" in err and len(err.strip().splitlines()) == 1


def _tiny_ask(monkeypatch, tmp_path, *extra: str, text: str = "the doctor works in paris .") -> list[str]:
    """argv of ``ask --doc`` on the tiny model (loaded in place of the real one)."""
    import kvblend.cli
    from tests.conftest import make_loaded

    monkeypatch.setattr(kvblend.cli, "_load", lambda args: make_loaded())
    doc = tmp_path / "d.txt"
    doc.write_text(text)
    return ["ask", "--doc", str(doc), "who is the doctor ?", "--max-tokens", "2", "--json",
            "--store-dir", str(tmp_path / "kv"), *extra]


def test_ask_doc_stores_under_the_tenant_it_is_given(capsys, monkeypatch, tmp_path) -> None:
    """``--tenant`` was ignored with ``--doc``: the KV went to tenant default."""
    assert main(_tiny_ask(monkeypatch, tmp_path, "--tenant", "acme")) == 0
    stored = [p.relative_to(tmp_path / "kv") for p in (tmp_path / "kv").rglob("*.safetensors")]
    assert stored and all("acme" in str(p) and "default" not in str(p) for p in stored), stored


def test_ask_doc_cuts_documents_as_the_server_does(capsys, monkeypatch, tmp_path) -> None:
    """``documents.chunk_tokens`` (the server's cut) was ignored: a --doc file never shared
    chunk KV with a server that changed it."""
    monkeypatch.setenv("KVBLEND_DOCUMENTS__CHUNK_TOKENS", "4")
    assert main(_tiny_ask(monkeypatch, tmp_path, text="the doctor works in paris . the city river")) == 0
    docs = json.loads(capsys.readouterr().out)["stats"]["docs"]
    assert [d["tokens"] for d in docs] == [4, 4, 1]  # 9 tokens in windows of 4


def test_ask_doc_refuses_retrieval_flags_it_would_ignore(capsys, monkeypatch, tmp_path) -> None:
    assert main(_tiny_ask(monkeypatch, tmp_path, "--chunks", "3", "--retriever", "bm25")) == 2
    assert "--chunks, --retriever" in capsys.readouterr().err


def test_a_store_flag_adds_its_tier_when_the_settings_leave_it_out(monkeypatch, tmp_path) -> None:
    """``ingest --store-dir`` with ``store.tiers: [memory]`` dropped the flag and the KV."""
    import argparse

    from kvblend.commands.ingest import store_config

    monkeypatch.setenv("KVBLEND_STORE__TIERS", '["memory"]')
    args = argparse.Namespace(store_dir=str(tmp_path / "kv"), redis_url="redis://127.0.0.1:1/0")
    config = store_config(args, "fp32", memory=False)
    assert config.enabled_tiers == ("disk", "redis") and config.disk_dir == str(tmp_path / "kv")
    assert store_config(argparse.Namespace(store_dir=None, redis_url=None), "fp32").enabled_tiers == ("memory",)
    monkeypatch.setenv("KVBLEND_STORE__TIERS", '["memory", "redis"]')
    monkeypatch.setenv("KVBLEND_STORE__REDIS_URL", "redis://127.0.0.1:1/0")
    flagged = argparse.Namespace(store_dir=str(tmp_path / "kv"), redis_url=None)
    assert store_config(flagged, "fp32").enabled_tiers == ("memory", "disk", "redis")  # looked up in that order


def test_text_on_stdin_that_is_not_utf8_is_a_clear_error(capsys, monkeypatch) -> None:
    import io

    class Stdin:
        buffer = io.BytesIO("café".encode("latin-1"))

        def isatty(self) -> bool:
            return False

    monkeypatch.setattr("sys.stdin", Stdin())
    assert main(["generate", "--model", "/nowhere/x.gguf"]) == 2
    err = capsys.readouterr().err
    assert "stdin is not UTF-8 (byte 3)" in err and len(err.strip().splitlines()) == 1


def test_paths_that_are_not_what_a_command_needs_are_one_clear_line(capsys, tmp_path) -> None:
    """FileExistsError, IsADirectoryError and the like were shown by class name."""
    a_file = tmp_path / "a.txt"
    a_file.write_text("x")
    assert main(["eval", "--dataset", str(tmp_path / "nope.json"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "No such file or directory" in err and "nope.json" in err and "Error:" not in err
    assert main(["ask", "why?", "--index", str(tmp_path / "typo")]) == 2
    assert "no index at" in capsys.readouterr().err and not (tmp_path / "typo").exists()


def test_demo_question_count_must_be_positive(capsys) -> None:
    import pytest

    with pytest.raises(SystemExit):
        main(["demo", "--questions", "-2"])
    assert "must be at least 1" in capsys.readouterr().err


def test_an_unknown_device_is_one_line_before_any_loading(capsys) -> None:
    assert main(["generate", "--device", "banana", "hi"]) == 2  # was torch's long RuntimeError, rc 1
    err = capsys.readouterr().err
    assert "unknown torch device 'banana'" in err and len(err.strip().splitlines()) == 1


def test_a_misspelt_setting_in_a_section_stops_every_command(capsys, monkeypatch) -> None:
    """``generate``, ``models``, ``eval`` read only the model settings and ignored a misspelt
    ``KVBLEND_STORE__MEMORYBYTES``; the README promises every command refuses it."""
    monkeypatch.setenv("KVBLEND_STORE__MEMORYBYTES", "1")
    assert main(["models"]) == 2
    assert "store.memorybytes" in capsys.readouterr().err


def test_help_is_shown_while_the_settings_are_broken(capsys, monkeypatch) -> None:
    """A broken setting stopped even ``kvblend ask --help``, which a user reads to fix it."""
    import pytest

    monkeypatch.setenv("KVBLEND_BLEND__RATIO", "7")
    with pytest.raises(SystemExit) as exit_:
        main(["ask", "--help"])
    out = capsys.readouterr()
    assert exit_.value.code == 0 and "--ratio" in out.out and "default 0.2" in out.out  # built-in defaults
    assert "blend.ratio" in out.err  # the error is said first
    assert main(["models"]) == 2  # a command still refuses to run on them
    assert "blend.ratio" in capsys.readouterr().err
