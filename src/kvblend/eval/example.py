"""The one evaluation example type, below the dataset loaders and the synthetic generator."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Example:
    """One question with its documents (in prompt order) and its reference answers."""

    question: str
    documents: tuple[str, ...]
    answers: tuple[str, ...]
    id: str

    def __post_init__(self) -> None:
        if isinstance(self.documents, str) or isinstance(self.answers, str):
            raise ValueError(f"example {self.id!r}: documents and answers must be sequences, not str")
        object.__setattr__(self, "documents", tuple(self.documents))
        object.__setattr__(self, "answers", tuple(self.answers))
        if not isinstance(self.question, str):
            raise ValueError(f"example {self.id!r}: question must be a string")
        for field in ("documents", "answers"):
            if not all(isinstance(x, str) for x in getattr(self, field)):
                raise ValueError(f"example {self.id!r}: {field} must be strings")
