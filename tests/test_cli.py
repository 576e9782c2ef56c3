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
