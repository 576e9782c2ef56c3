"""Subcommands of ``kvblend`` that compose several packages, kept above them so that the
packages' imports run one way: ``ingest`` (and ``ask`` by retrieval) over ``kvblend.rag``
and the engine, ``profile`` over ``kvblend.pipeline`` and the engine. ``kvblend.cli`` builds
the parser from them."""
