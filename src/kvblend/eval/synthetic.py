"""Seeded two-hop questions whose answer needs facts from two different documents.

Each example joins a chain ``entity -> bridge -> answer``: the first hop document says
how the question's entity relates to a bridge (a project codename, a company, a novel),
the second says how the bridge relates to the answer, and the question names only the
entity. A model that cannot attend across documents (full KV reuse) cannot connect
them, which is the failure CacheBlend's selective recompute is meant to repair.
The other documents are distractors carrying one hop of an unrelated chain; all
documents are padded with neutral filler sentences to about ``doc_tokens`` tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvblend.eval.example import Example

TOKENS_PER_WORD = 1.3

TITLES = ("Dr. ", "Prof. ", "", "")
FIRST_NAMES = (
    "Amara", "Tobias", "Ingrid", "Rafael", "Mei", "Kwame", "Elena", "Dmitri", "Priya", "Lucas",
    "Noor", "Henrik", "Mateo", "Aiko", "Olusegun", "Clara", "Farid", "Greta", "Hamza", "Isabel",
    "Jonas", "Keiko", "Leandro", "Marisol", "Nikolai", "Odette", "Pavel", "Rosalind", "Samir",
    "Tamsin", "Ulrich", "Vera", "Wendell", "Ximena", "Yusuf", "Zofia", "Anselm", "Beatrix", "Cyrus",
)
LAST_NAMES = (
    "Okafor", "Lindqvist", "Moreau", "Tanaka", "Ferreira", "Kowalski", "Haddad", "Novak",
    "Castellano", "Brennan", "Achebe", "Sorensen", "Petrova", "Yamamoto", "Delacroix", "Ibarra",
    "Mensah", "Nakamura", "Oyelaran", "Rasmussen", "Valdivia", "Whitcombe", "Zielinski",
    "Abernathy", "Bertolini", "Chakraborty", "Dubois", "Eriksen", "Fontaine", "Gallagher",
    "Halvorsen", "Iwasaki", "Jablonski", "Kariuki", "Laurent", "Montague", "Nwosu", "Ostrowski",
    "Pellegrini", "Quintero", "Szabo", "Umarov", "Vasquez", "Wexler",
)
CODENAMES = (
    "Bluefin", "Kestrel", "Marlin", "Osprey", "Tamarack", "Halyard", "Cormorant", "Juniper",
    "Quasar", "Nimbus", "Zephyr", "Obsidian", "Tarragon", "Bramble", "Sextant", "Foxglove",
    "Lodestar", "Mistral", "Peregrine", "Starling", "Wolfram", "Caldera", "Anvil", "Basilisk",
    "Corvid", "Dunlin", "Fulcrum", "Gannet", "Heliotrope", "Ibex", "Jackdaw", "Kingfisher",
    "Lynx", "Merlin", "Narwhal", "Onyx", "Pangolin", "Quokka", "Sandpiper", "Tamarin",
)
COMPANY_HEADS = (
    "Northwind", "Brightwater", "Ironleaf", "Cobaltis", "Meridian", "Halcyon", "Quillon",
    "Vantor", "Solenta", "Arcturus", "Bellwether", "Crestline", "Deepfield", "Everpine",
    "Fairhaven", "Goldcrest", "Highmoor", "Ivorygate", "Keystone", "Larkspur", "Millbrook",
    "Nettlefield", "Oakhurst", "Pinecrest", "Redmarsh", "Silverline", "Thornbury", "Upland",
    "Westbrook", "Yarrow", "Ashgrove", "Blackwood", "Coldharbour", "Driftwood", "Elmstead",
    "Foxley", "Greystone", "Harrowgate", "Kingsmere", "Lindenfield",
)
COMPANY_SUFFIXES = (
    "Logistics", "Systems", "Dynamics", "Laboratories", "Textiles", "Foods", "Robotics",
    "Shipping", "Instruments", "Analytics", "Ceramics", "Pharmaceuticals", "Optics", "Holdings",
)
NOVEL_HEADS = (
    "Amber", "Silent", "Hollow", "Crimson", "Distant", "Forgotten", "Gilded", "Hidden", "Lonely",
    "Midnight", "Northern", "Painted", "Restless", "Scarlet", "Shattered", "Sleeping", "Sunken",
    "Tangled", "Velvet", "Wandering", "Wicked", "Burning", "Broken", "Crooked", "Drowned",
    "Endless", "Fading", "Frozen", "Glass", "Howling", "Lost", "Marble", "Nameless", "Pale",
    "Rusted", "Salt", "Secret", "Shadowed", "Stolen", "Twelfth",
)
NOVEL_NOUNS = (
    "Lantern", "Orchard", "Harbour", "Compass", "Mirror", "Tide", "Cathedral", "Meadow",
    "Labyrinth", "Lighthouse", "Citadel", "Archive", "Voyage", "Sparrow", "Hourglass",
    "Mountain", "Tapestry", "Kingdom",
)
CITIES = (
    "Lisbon", "Porto", "Madrid", "Seville", "Valencia", "Lyon", "Marseille", "Geneva", "Zurich",
    "Basel", "Vienna", "Prague", "Krakow", "Warsaw", "Gdansk", "Riga", "Tallinn", "Vilnius",
    "Helsinki", "Oslo", "Bergen", "Stockholm", "Uppsala", "Copenhagen", "Aarhus", "Hamburg",
    "Munich", "Leipzig", "Dresden", "Cologne", "Antwerp", "Ghent", "Rotterdam", "Utrecht",
    "Dublin", "Cork", "Glasgow", "Edinburgh", "Leeds", "Bristol", "Cardiff", "Naples", "Turin",
    "Bologna", "Verona", "Athens", "Thessaloniki", "Sofia", "Bucharest", "Budapest", "Ljubljana",
    "Zagreb", "Belgrade", "Ankara", "Cairo", "Tunis", "Casablanca", "Nairobi", "Accra", "Lagos",
    "Montreal", "Toronto", "Quebec", "Denver", "Seattle", "Lima", "Quito", "Bogota", "Osaka",
    "Kyoto", "Busan", "Hanoi", "Manila", "Adelaide", "Auckland",
)
YEARS = tuple(str(y) for y in range(1820, 1990))

FILLER_TEMPLATES = (
    "The {adj} {place} was {done} {when}.",
    "Many {people} {liked} the {adj} {place} {when}.",
    "Some {people} prefer {activity} near the {place} {when}.",
    "The weather near the {place} was {weather} {when}.",
    "A {adj} path leads from the {place} to the {look} {thing}.",
    "Local {people} often talk about the {thing} near the {place}.",
    "Every {season}, the {place} hosts a small {event} for {people}.",
    "It is said that the {thing} by the {place} is older than it looks.",
    "The {look} {thing} in the {adj} {place} was {done} {when}.",
    "From the {place}, one can see the {look} {thing} on a {weather} day.",
)
FILLER_WORDS = {
    "adj": ("narrow", "busy", "wooden", "sunny", "shaded", "crowded", "small", "wide", "tidy",
            "modern", "peaceful", "colourful", "spacious", "humble", "charming"),
    "look": ("weathered", "tall", "slender", "bronze", "restored", "carved", "sturdy", "ornate",
             "old"),
    "place": ("market", "library", "courtyard", "station", "museum", "bakery", "workshop",
              "school", "park", "square", "pier", "corridor", "greenhouse", "village hall",
              "bus depot", "town garden"),
    "done": ("repainted", "cleaned", "reopened", "expanded", "inspected", "renovated",
             "photographed", "measured", "decorated", "rebuilt"),
    "when": ("last spring", "in the autumn", "early in the morning", "after the long winter",
             "on most weekends", "late in the evening", "every summer", "a few years ago",
             "during the holidays", "before noon"),
    "people": ("visitors", "students", "neighbours", "tourists", "volunteers", "teachers",
               "families", "residents", "walkers", "cyclists", "artists", "children"),
    "liked": ("praised", "visited", "mentioned", "admired", "enjoyed", "recommended", "described"),
    "activity": ("reading", "walking", "sketching", "resting", "chatting", "gardening",
                 "painting", "knitting"),
    "weather": ("mild", "windy", "cool", "warm", "damp", "bright", "calm", "cloudy", "foggy",
                "crisp"),
    "thing": ("fountain", "statue", "clock", "bench", "mural", "lamp", "gate", "oak tree", "well",
              "fence", "sundial", "bell tower"),
    "season": ("spring", "summer", "autumn", "winter"),
    "event": ("concert", "fair", "exhibition", "lecture", "festival", "picnic", "book sale",
              "craft market"),
}


@dataclass(frozen=True)
class ChainTemplate:
    """One kind of two-hop chain: sentence patterns for each hop and the question.

    Patterns use the fields ``{entity}``, ``{bridge}`` and ``{answer}``; the first hop
    names entity and bridge, the second bridge and answer, the question only entity.
    """

    kind: str
    first_hop: tuple[str, ...]
    second_hop: tuple[str, ...]
    question: str


@dataclass(frozen=True)
class Chain:
    """A drawn chain: which template, and the entity, bridge and answer strings."""

    template: ChainTemplate
    entity: str
    bridge: str
    answer: str

    def hop_sentence(self, rng: random.Random, hop: int) -> str:
        patterns = self.template.first_hop if hop == 0 else self.template.second_hop
        return rng.choice(patterns).format(entity=self.entity, bridge=self.bridge, answer=self.answer)

    @property
    def question(self) -> str:
        return self.template.question.format(entity=self.entity)


TEMPLATES = (
    ChainTemplate(
        kind="project",
        first_hop=("The project codenamed {bridge} is led by {entity}.",
                   "{entity} leads the research project codenamed {bridge}."),
        second_hop=("{bridge}'s budget was approved in the city of {answer}.",
                    "The budget for {bridge} was signed off at a meeting in {answer}."),
        question="In which city was the budget of the project led by {entity} approved?",
    ),
    ChainTemplate(
        kind="employer",
        first_hop=("{entity} works as an engineer at {bridge}.",
                   "After years abroad, {entity} joined {bridge} as a senior analyst."),
        second_hop=("{bridge} is headquartered in {answer}.",
                    "The head office of {bridge} is located in {answer}."),
        question="In which city is the company that {entity} works for headquartered?",
    ),
    ChainTemplate(
        kind="novel",
        first_hop=("{entity} is the author of the novel {bridge}.",
                   "The novel {bridge} was written by {entity}."),
        second_hop=("{bridge} was first published in {answer}.",
                    "The first edition of {bridge} appeared in {answer}."),
        question="In which year was the novel written by {entity} first published?",
    ),
)

MAX_DOCS = 1 + min(len(LAST_NAMES), len(CODENAMES), len(COMPANY_HEADS), len(NOVEL_HEADS), len(CITIES))


@dataclass(frozen=True)
class SyntheticExample(Example):
    """An `Example` that also records where its answer chain lives.

    ``hop_indices`` = (index of the document linking entity to bridge, index of the
    document linking bridge to answer); every other document is a distractor.
    """

    kind: str
    entity: str
    bridge: str
    hop_indices: tuple[int, int]


def _draw_unique(rng: random.Random, pool: tuple[str, ...], used: set[str]) -> str:
    """A random pool member not in ``used``, which is then marked used."""
    choice = rng.choice([x for x in pool if x not in used])
    used.add(choice)
    return choice


def _draw_bridge(rng: random.Random, kind: str, used: set[str]) -> str:
    if kind == "project":
        return _draw_unique(rng, CODENAMES, used)
    if kind == "employer":
        return f"{_draw_unique(rng, COMPANY_HEADS, used)} {rng.choice(COMPANY_SUFFIXES)}"
    return f"{_draw_unique(rng, NOVEL_HEADS, used)} {rng.choice(NOVEL_NOUNS)}"


def _draw_chain(rng: random.Random, used: set[str]) -> Chain:
    """A chain whose last name, bridge head and answer are all new to ``used``."""
    template = rng.choice(TEMPLATES)
    last = _draw_unique(rng, LAST_NAMES, used)
    entity = f"{rng.choice(TITLES)}{rng.choice(FIRST_NAMES)} {last}"
    bridge = _draw_bridge(rng, template.kind, used)
    answer = _draw_unique(rng, YEARS if template.kind == "novel" else CITIES, used)
    return Chain(template, entity, bridge, answer)


def _filler_sentence(rng: random.Random) -> str:
    template = rng.choice(FILLER_TEMPLATES)
    return template.format(**{slot: rng.choice(words) for slot, words in FILLER_WORDS.items()})


def _filler(rng: random.Random, n_words: int) -> list[str]:
    """Filler sentences totalling about ``n_words`` words (within half a sentence)."""
    sentences: list[str] = []
    remaining = n_words
    while remaining > 0:
        sentence = _filler_sentence(rng)
        length = len(sentence.split())
        if length >= 2 * remaining:
            break
        sentences.append(sentence)
        remaining -= length
    return sentences


def _document(rng: random.Random, fact: str, doc_tokens: int) -> str:
    """``fact`` at a random sentence position inside filler of about ``doc_tokens`` tokens."""
    target_words = round(doc_tokens / TOKENS_PER_WORD)
    sentences = _filler(rng, target_words - len(fact.split()))
    sentences.insert(rng.randint(0, len(sentences)), fact)
    return " ".join(sentences) + "\n\n"


def _decoy_fact(rng: random.Random, used: set[str]) -> str:
    """One hop, either side, of a fresh unrelated chain."""
    return _draw_chain(rng, used).hop_sentence(rng, rng.randrange(2))


def _example(rng: random.Random, example_id: str, n_docs: int, doc_tokens: int) -> SyntheticExample:
    used: set[str] = set()
    chain = _draw_chain(rng, used)
    decoys = iter([_decoy_fact(rng, used) for _ in range(n_docs - 2)])
    first, second = rng.sample(range(n_docs), 2)
    hops = {first: chain.hop_sentence(rng, 0), second: chain.hop_sentence(rng, 1)}
    facts = [hops[i] if i in hops else next(decoys) for i in range(n_docs)]
    return SyntheticExample(
        question=chain.question,
        documents=tuple(_document(rng, fact, doc_tokens) for fact in facts),
        answers=(chain.answer,),
        id=example_id,
        kind=chain.template.kind,
        entity=chain.entity,
        bridge=chain.bridge,
        hop_indices=(first, second),
    )


def generate_synthetic(
    n: int, n_docs: int = 4, doc_tokens: int = 256, seed: int = 0
) -> list[SyntheticExample]:
    """``n`` two-hop examples with ``n_docs`` documents of about ``doc_tokens`` tokens each.

    Lengths are estimated at `TOKENS_PER_WORD` tokens per word (no tokenizer); a
    document is never shorter than its fact sentence. Each document ends with a blank
    line, as MuSiQue passages do. Example ``i`` depends only on ``seed`` and ``i``, so
    a smaller ``n`` yields a prefix of a larger one.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not 2 <= n_docs <= MAX_DOCS:
        raise ValueError(f"n_docs must be in [2, {MAX_DOCS}], got {n_docs}")
    if doc_tokens < 1:
        raise ValueError(f"doc_tokens must be >= 1, got {doc_tokens}")
    examples = []
    for i in range(n):
        rng = random.Random(f"kvblend-synthetic:{seed}:{i}")
        examples.append(_example(rng, f"synthetic-{seed}-{i}", n_docs, doc_tokens))
    return examples
