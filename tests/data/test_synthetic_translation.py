import random
import re

import pytest

from macformer_lit.data.synthetic_translation import (
    ANIMAL_FORMS,
    ANIMALS,
    AUX,
    HUMANS,
    MOTION,
    ON_PLACES,
    PLACES,
    STATIC,
    SUB_CONJ,
    THAT_VERBS,
    THINGS,
    TIMES,
    TRANSITIVE,
    SyntheticTranslationDataModule,
    generate_pair,
    generate_split,
    sentence_stats,
)

VERBS = [t[0] for t in TRANSITIVE] + list(MOTION + STATIC + THAT_VERBS)
GERMAN_FINITE = (
    {v[3] for v in VERBS}
    | {v[4] for v in VERBS}
    | {w for forms in ANIMAL_FORMS.values() for w in forms[:2]}
    | {w for a in AUX.values() for w in a[2:]}
    | {"kann", "können", "muss", "müssen", "darf", "dürfen", "will", "wollen"}
)
SUBORDINATORS = {de for _, de in SUB_CONJ} | {"dass"}
TINY = dict(
    train_size=200, val_size=20, test_size=30, tokenizer_vocab_size=300, batch_size=8, max_len=128
)


def pairs(n=3000, seed=0):
    rng = random.Random(seed)
    return [generate_pair(rng) for _ in range(n)]


def words(sentence):
    return sentence.replace(",", " ,").rstrip(".").split()


def single_clauses(n=6000):
    """Pairs of one clause: no conjunction, no that-clause, no comma."""
    conj = {en for en, _ in SUB_CONJ} | {"and", "but", "or", "that", "as", "before"}
    return [(en, de) for en, de in pairs(n) if not conj & set(words(en)) and "," not in en]


def test_the_grammar_is_a_function_both_ways():
    en2de, de2en = {}, {}
    for en, de in pairs():
        assert en2de.setdefault(en, de) == de
        assert de2en.setdefault(de, en) == en


def test_agreement_and_reordering():
    seen = set()
    for en, de in pairs():
        e, d = words(en), words(de)
        # Verb-second after a time adverb: the finite verb precedes the subject.
        if e[0] in {t for t, _ in TIMES}:
            assert d[1] in GERMAN_FINITE
            seen.add("v2")
        # Verb-final in every subordinate clause (clauses end at commas, und, oder).
        for clause in re.split(r" , | und | oder ", " ".join(d)):
            first, *_, last = clause.split()
            if first in SUBORDINATORS:
                assert last in GERMAN_FINITE, (clause, de)
                if clause.split()[-2] not in GERMAN_FINITE:
                    seen.add("verb-final")
        # A fronted subordinate clause: the main clause starts with its finite verb.
        if e[0] in {c for c, _ in SUB_CONJ} and d[0] != "dass":
            after = de.split(", ")[1].split()
            assert after[0] in GERMAN_FINITE
            seen.add("fronted clause")
        for article in ("a", "an"):
            for i in (i for i, w in enumerate(e) if w == article):
                assert (e[i + 1][0] in "aeiou") == (article == "an")
                seen.add(article)
        text = f" {de} "
        for phrase, tag in (
            (" ein großer ", "m"),
            (" eine große ", "f"),
            (" ein großes ", "n"),
            (" einen großen ", "m acc"),
            (" mit großen ", "dat pl"),
            (" den jungen ", "weak noun"),
        ):
            if phrase in text:
                seen.add(tag)
        # Contracted: "in dem" is "im", "zu der" "zur" and so on.
        for pair in (" in dem ", " in das ", " an dem ", " von dem ", " zu dem ", " zu der "):
            assert pair not in text
        # One negation per negated clause: nicht, or kein before an indefinite object.
        negations = sum(w in ("not", "cannot") for w in e)
        assert negations == sum(w == "nicht" or w.startswith("kein") for w in d)
        if any(w.startswith("kein") for w in d):
            seen.add("kein")
    assert seen >= {
        "v2", "verb-final", "fronted clause", "a", "an", "m", "f", "n", "m acc", "dat pl",
        "weak noun", "kein",
    }  # fmt: skip


def test_the_subject_agrees_with_its_verb():
    singular = {v[3] for v in VERBS} | {f[0] for f in ANIMAL_FORMS.values()}
    singular |= {"hat", "ist", "kann", "muss", "darf", "will"}
    plural = GERMAN_FINITE - singular
    singular_nouns = {n[0] for n in HUMANS + ANIMALS}
    plural_nouns = {n[1] for n in HUMANS + ANIMALS}
    for en, de in single_clauses():
        e, d = words(en), words(de)
        # The subject is the first noun; its finite verb the first German verb form.
        subject = next(w for w in e if w in singular_nouns | plural_nouns)
        finite = next(w for w in d if w in GERMAN_FINITE)
        is_plural = subject in plural_nouns
        assert finite in (plural if is_plural else singular), (en, de)


def test_context_decides_the_translation():
    humans = {w for n in HUMANS for w in n[:2]}
    animals = {w for n in ANIMALS for w in n[:2]}
    motion = {w for v in MOTION for w in v[:3]}
    static = {w for v in STATIC for w in v[:3]}
    seen = set()
    for en, de in single_clauses():
        e, d = words(en), words(de)
        subject = next(w for w in e if w in humans | animals)
        # eats / drinks: isst / trinkt for people, frisst / säuft for animals.
        for en_forms, human_forms, animal_forms in (
            ({"eats", "eat", "eaten"}, {"isst", "essen", "gegessen"}, set(ANIMAL_FORMS["eats"])),
            (
                {"drinks", "drink", "drunk"},
                {"trinkt", "trinken", "getrunken"},
                set(ANIMAL_FORMS["drinks"]),
            ),
        ):
            if en_forms & set(e):
                expected, other = (
                    (human_forms, animal_forms)
                    if subject in humans
                    else (animal_forms, human_forms)
                )
                assert expected & set(d) and not other & set(d), (en, de)
                seen.add("human" if subject in humans else "animal")
        # "in the <place>": accusative (direction) after motion, dative (location) otherwise.
        for place in (p for p in PLACES if p[4] != "f" and not p[6]):
            if f" in the {place[0]} " in f" {en[:-1]} ":
                if motion & set(e):
                    assert ("ins " if place[4] == "n" else "in den ") + place[2] in de
                    seen.add("ins")
                elif static & set(e):
                    assert f"im {place[2]}" in de
                    seen.add("im")
        # "on": an on vertical surfaces, auf on horizontal ones.
        for place in ON_PLACES:
            if f" on the {place[0]} " in f" {en[:-1]} ":
                prep = re.search(rf"\b(auf|an|am|ans) (?:\w+ )?{place[2]}\b", de).group(1)
                assert (prep in ("an", "am", "ans")) == (place[6] == "an"), (en, de)
                seen.add(place[6])
    assert seen >= {"human", "animal", "ins", "im", "auf", "an"}


def test_context_words_counted_over_whole_sentences():
    things = {w for n in THINGS for w in n[:2]}
    places = {w for n in PLACES for w in n[:2]}
    participles = {v[2]: v[6] for v in VERBS}
    for en, de in pairs():
        e, d = words(en), words(de)
        # knows: weiß before a that-clause, kennt before a noun phrase.
        know = [i for i, w in enumerate(e) if w in ("knows", "know", "known")]
        that = sum(e[i + 1] == "that" for i in know)
        assert that == sum(w in ("weiß", "wissen", "gewusst") for w in d)
        assert len(know) - that == sum(w in ("kennt", "kennen", "gekannt") for w in d)
        assert e.count("that") == d.count("dass")
        # light: leicht for things, hell for places.
        light_nouns = [next(w for w in e[i:] if w in things | places) for i, w in
                       enumerate(e) if w == "light"]  # fmt: skip
        assert sum(n in things for n in light_nouns) == sum(w.startswith("leicht") for w in d)
        assert sum(n in places for n in light_nouns) == sum(w.startswith("hell") for w in d)
        # The perfect takes "ist" with verbs of motion and folgen, "hat" otherwise.
        ist = sum(
            w in ("has", "have") and participles.get(e[i + 1 + (e[i + 1] == "not")]) == "ist"
            for i, w in enumerate(e[:-1])
        )
        assert ist == sum(w in ("ist", "sind") for w in d)
        # must not forbids: darf nicht.
        must_not = sum(e[i : i + 2] == ["must", "not"] for i in range(len(e)))
        assert must_not == sum(w in ("darf", "dürfen") for w in d)


def test_sentence_lengths_as_documented():
    en, de = zip(*pairs(5000))
    for side in (en, de):
        stats = sentence_stats(list(side))
        assert 14 <= stats["mean"] <= 19 and stats["median"] >= 13 and 40 <= stats["max"] <= 60
    assert sum(len(words(s)) >= 30 for s in en) > 100


def test_splits_are_seeded_and_disjoint(tmp_path):
    assert generate_split(0, "train", 50) == generate_split(0, "train", 50)
    assert generate_split(0, "train", 50) != generate_split(1, "train", 50)
    assert generate_split(0, "train", 20) == generate_split(0, "train", 50)[:20]
    dm = SyntheticTranslationDataModule(data_dir=str(tmp_path), **TINY)
    train = set(dm.split_texts("train")[0])
    for split in ("val", "test"):
        src, tgt = dm.split_texts(split)
        assert len(src) == TINY[f"{split}_size"] and not train & set(src)
    # The German is a function of the English: a sentence gets the same translation in
    # every split and stream.
    translation = {}
    for seed in (0, 1):
        for split in ("train", "val", "test"):
            for en, de in generate_split(seed, split, 500):
                assert translation.setdefault(en, de) == de


def test_datamodule_batches_and_round_trip(tmp_path):
    dm = SyntheticTranslationDataModule(data_dir=str(tmp_path), **TINY)
    assert (dm.pad_id, dm.bos_id, dm.eos_id) == (0, 1, 2) and dm.vocab_size <= 300
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["src_ids"].shape[0] == 8 and len(batch["tgt_text"]) == 8
    assert batch["src_padding_mask"].sum() == sum(
        len(ids) for ids in dm.encode_source(batch["src_text"])
    )
    for ids, text in zip(batch["tgt_ids"].tolist(), batch["tgt_text"]):
        assert dm.detokenize(ids[1:]) == text
    reverse = SyntheticTranslationDataModule(
        data_dir=str(tmp_path), src_lang="de", tgt_lang="en", **TINY
    )
    de, en = reverse.split_texts("train")
    assert (en, de) == dm.split_texts("train")


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="unknown language pair en→fr"):
        SyntheticTranslationDataModule(data_dir=str(tmp_path), tgt_lang="fr")
    for name in ("train_size", "val_size", "batch_size", "max_len"):
        with pytest.raises(ValueError, match=name):
            SyntheticTranslationDataModule(data_dir=str(tmp_path), **{**TINY, name: 0})
