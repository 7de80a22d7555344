"""A toy English→German translation task generated from a deterministic grammar.

The same batch format as Multi30K (``translation.py``), so translation runs and is tested
with no download. The grammar is a function both ways: every English sentence has exactly
one German translation and back, so a perfect model scores BLEU 100. It is built to be hard
for a small Transformer trained for minutes (a softmax baseline ends still learning, as on
Multi30K, leaving room to tell attention methods apart; docs/data.md §10 has the numbers):

- a larger lexicon (about 320 English and 460 German word forms in use): 34 animate nouns
  (humans and animals), 20 things, 5 mass nouns, 22 places, 28 adjectives, 31 verbs, 3
  modals, 10 time adverbs, 14 prepositions, 9 conjunctions;
- longer sentences: up to three clauses, a ``that``-clause under *knows / says / believes
  / hears*, noun phrases with up to two adjectives, prepositional phrases, negation,
  present, perfect and modal verb groups; 16 words on average in either language (median
  16, 1 in 20 sentences over 30), up to about 50 (``sentence_stats``); the first version of
  this task had about 8;
- agreement: articles and adjective endings follow gender, number, definiteness and case
  (nominative subjects, accusative objects, dative or accusative after prepositions; weak,
  mixed and strong adjective endings: ``der große hund``, ``einen großen hund``,
  ``große hunde``, ``mit großen hunden``, ``kalte milch``); weak nouns (``den jungen``);
  finite verbs agree with the subject; contractions (``im``, ``ins``, ``am``, ``zum``);
- reordering: verb-second after a fronted time adverb or a fronted subordinate clause
  (``heute schläft der hund``, ``weil der hund schläft, spielt die katze``); verb-final in
  subordinate clauses (``weil``, ``während``, ``obwohl``, ``wenn``, ``dass``); the
  participle or infinitive at the end of its clause (``der hund hat den apfel gefressen``,
  ``weil der hund schwimmen kann``); an English clause-final time adverb moves right after
  the German finite verb (``the dog eats the apple today`` → ``der hund frisst heute den
  apfel``); the postposition ``entlang`` (``along the river`` → ``den fluss entlang``);
- words whose translation depends on context elsewhere in the sentence:
  *eats / drinks* is ``isst / trinkt`` for a human subject and ``frisst / säuft`` for an
  animal (the subject may be several words away, or in the plural);
  *knows* is ``kennt`` before a noun phrase and ``weiß`` before a ``that``-clause;
  *in, on, under, behind, next to, in front of, above* take the accusative after a verb of
  motion and the dative otherwise (``runs in the house`` → ``läuft ins haus``, ``sleeps in
  the house`` → ``schläft im haus``); *on* is ``auf`` on horizontal surfaces and ``an`` on
  vertical ones (``auf dem tisch``, ``an der wand``); *light* is ``leicht`` for things and
  ``hell`` for places; *has* (perfect) is ``ist`` for verbs of motion and ``hat`` otherwise;
  *must not* is ``darf nicht``; *not* before an indefinite object becomes ``kein``
  (``does not eat an apple`` → ``isst keinen apfel``).

Sentence: ``[TIME] CLAUSE [CONJ CLAUSE [CONJ CLAUSE]] .`` (a subordinate clause may come
first), ``CLAUSE = NP VERB_GROUP [NP | that CLAUSE] [PP] [TIME]``. Each split is drawn from
its own seeded stream; validation and test sentences never occur in training.
"""

from __future__ import annotations

import random
import statistics
from typing import Any, Literal

from macformer_lit.data.translation import TranslationDataModule


def _pairs(text: str) -> tuple[tuple[str, str], ...]:
    """``"big:groß next_to:neben"`` → ``(("big", "groß"), ("next to", "neben"))``."""
    return tuple(tuple(w.replace("_", " ") for w in p.split(":")) for p in text.split())


# Nouns: (en singular, en plural or None for a mass noun, de singular, de plural, gender,
# de singular in the accusative/dative for weak nouns or "")
HUMANS = (
    ("man", "men", "mann", "männer", "m", ""),
    ("woman", "women", "frau", "frauen", "f", ""),
    ("child", "children", "kind", "kinder", "n", ""),
    ("girl", "girls", "mädchen", "mädchen", "n", ""),
    ("boy", "boys", "junge", "jungen", "m", "jungen"),
    ("teacher", "teachers", "lehrer", "lehrer", "m", ""),
    ("doctor", "doctors", "arzt", "ärzte", "m", ""),
    ("farmer", "farmers", "bauer", "bauern", "m", "bauern"),
    ("student", "students", "student", "studenten", "m", "studenten"),
    ("cook", "cooks", "koch", "köche", "m", ""),
    ("king", "kings", "könig", "könige", "m", ""),
    ("queen", "queens", "königin", "königinnen", "f", ""),
    ("baker", "bakers", "bäcker", "bäcker", "m", ""),
    ("friend", "friends", "freund", "freunde", "m", ""),
    ("sister", "sisters", "schwester", "schwestern", "f", ""),
    ("brother", "brothers", "bruder", "brüder", "m", ""),
    ("nurse", "nurses", "pflegerin", "pflegerinnen", "f", ""),
)
ANIMALS = (
    ("dog", "dogs", "hund", "hunde", "m", ""),
    ("cat", "cats", "katze", "katzen", "f", ""),
    ("bird", "birds", "vogel", "vögel", "m", ""),
    ("horse", "horses", "pferd", "pferde", "n", ""),
    ("owl", "owls", "eule", "eulen", "f", ""),
    ("cow", "cows", "kuh", "kühe", "f", ""),
    ("mouse", "mice", "maus", "mäuse", "f", ""),
    ("duck", "ducks", "ente", "enten", "f", ""),
    ("bear", "bears", "bär", "bären", "m", "bären"),
    ("goat", "goats", "ziege", "ziegen", "f", ""),
    ("wolf", "wolves", "wolf", "wölfe", "m", ""),
    ("lion", "lions", "löwe", "löwen", "m", "löwen"),
    ("pig", "pigs", "schwein", "schweine", "n", ""),
    ("rabbit", "rabbits", "hase", "hasen", "m", "hasen"),
    ("fox", "foxes", "fuchs", "füchse", "m", ""),
    ("donkey", "donkeys", "esel", "esel", "m", ""),
    ("monkey", "monkeys", "affe", "affen", "m", "affen"),
)
ANIMATES = HUMANS + ANIMALS
FOODS = (
    ("apple", "apples", "apfel", "äpfel", "m", ""),
    ("bread", "breads", "brot", "brote", "n", ""),
    ("cake", "cakes", "kuchen", "kuchen", "m", ""),
    ("egg", "eggs", "ei", "eier", "n", ""),
    ("pear", "pears", "birne", "birnen", "f", ""),
    ("carrot", "carrots", "karotte", "karotten", "f", ""),
)
THINGS = FOODS + (
    ("ball", "balls", "ball", "bälle", "m", ""),
    ("book", "books", "buch", "bücher", "n", ""),
    ("letter", "letters", "brief", "briefe", "m", ""),
    ("key", "keys", "schlüssel", "schlüssel", "m", ""),
    ("bag", "bags", "tasche", "taschen", "f", ""),
    ("cup", "cups", "tasse", "tassen", "f", ""),
    ("bottle", "bottles", "flasche", "flaschen", "f", ""),
    ("hat", "hats", "hut", "hüte", "m", ""),
    ("box", "boxes", "kiste", "kisten", "f", ""),
    ("stone", "stones", "stein", "steine", "m", ""),
    ("flower", "flowers", "blume", "blumen", "f", ""),
    ("toy", "toys", "spielzeug", "spielzeuge", "n", ""),
    ("picture", "pictures", "bild", "bilder", "n", ""),
    ("chair", "chairs", "stuhl", "stühle", "m", ""),
)
READABLE = tuple(t for t in THINGS if t[0] in ("book", "letter"))
DRINKS = (
    ("water", None, "wasser", "", "n", ""),
    ("milk", None, "milch", "", "f", ""),
    ("tea", None, "tee", "", "m", ""),
    ("juice", None, "saft", "", "m", ""),
    ("coffee", None, "kaffee", "", "m", ""),
)
# Places add how English "on" is said: "auf" (horizontal), "an" (vertical) or "" (no "on").
PLACES = (
    ("house", "houses", "haus", "häuser", "n", "", ""),
    ("garden", "gardens", "garten", "gärten", "m", "", ""),
    ("kitchen", "kitchens", "küche", "küchen", "f", "", ""),
    ("room", "rooms", "zimmer", "zimmer", "n", "", ""),
    ("forest", "forests", "wald", "wälder", "m", "", ""),
    ("car", "cars", "auto", "autos", "n", "", ""),
    ("school", "schools", "schule", "schulen", "f", "", ""),
    ("park", "parks", "park", "parks", "m", "", ""),
    ("river", "rivers", "fluss", "flüsse", "m", "", ""),
    ("lake", "lakes", "see", "seen", "m", "", ""),
    ("shop", "shops", "laden", "läden", "m", "", ""),
    ("church", "churches", "kirche", "kirchen", "f", "", ""),
    ("table", "tables", "tisch", "tische", "m", "", "auf"),
    ("bed", "beds", "bett", "betten", "n", "", "auf"),
    ("street", "streets", "straße", "straßen", "f", "", "auf"),
    ("bridge", "bridges", "brücke", "brücken", "f", "", "auf"),
    ("roof", "roofs", "dach", "dächer", "n", "", "auf"),
    ("boat", "boats", "boot", "boote", "n", "", "auf"),
    ("wall", "walls", "wand", "wände", "f", "", "an"),
    ("door", "doors", "tür", "türen", "f", "", "an"),
    ("window", "windows", "fenster", "fenster", "n", "", "an"),
    ("tree", "trees", "baum", "bäume", "m", "", "an"),
)
IN_PLACES = tuple(p for p in PLACES if not p[6])
ON_PLACES = tuple(p for p in PLACES if p[6])
ANIMATE_ADJ = _pairs(
    "big:groß small:klein old:alt young:jung fast:schnell loud:laut angry:wütend "
    "happy:glücklich tired:müde hungry:hungrig brown:braun black:schwarz lazy:faul "
    "clever:klug strong:stark pretty:hübsch"
)
THING_ADJ = _pairs(
    "big:groß small:klein red:rot old:alt new:neu green:grün brown:braun black:schwarz "
    "dirty:schmutzig heavy:schwer light:leicht round:rund pretty:hübsch"
)
PLACE_ADJ = _pairs(
    "big:groß small:klein old:alt new:neu green:grün dirty:schmutzig light:hell quiet:ruhig "
    "pretty:hübsch cold:kalt"
)
DRINK_ADJ = _pairs("cold:kalt hot:heiß fresh:frisch sweet:süß")

# Verbs: (en 3rd singular, en base, en participle, de 3rd singular, de infinitive = 3rd
# plural, de participle, perfect auxiliary, who may be the subject)
TRANSITIVE = (
    (("eats", "eat", "eaten", "isst", "essen", "gegessen", "hat", "any"), FOODS, "acc"),
    (("drinks", "drink", "drunk", "trinkt", "trinken", "getrunken", "hat", "any"), DRINKS, "acc"),
    (("sees", "see", "seen", "sieht", "sehen", "gesehen", "hat", "any"), ANIMATES + THINGS, "acc"),
    (("likes", "like", "liked", "mag", "mögen", "gemocht", "hat", "any"), ANIMATES + THINGS, "acc"),
    (
        ("finds", "find", "found", "findet", "finden", "gefunden", "hat", "any"),
        ANIMALS + THINGS,
        "acc",
    ),
    (
        ("knows", "know", "known", "kennt", "kennen", "gekannt", "hat", "any"),
        ANIMATES + PLACES,
        "acc",
    ),
    (("carries", "carry", "carried", "trägt", "tragen", "getragen", "hat", "human"), THINGS, "acc"),
    (("holds", "hold", "held", "hält", "halten", "gehalten", "hat", "human"), THINGS, "acc"),
    (("buys", "buy", "bought", "kauft", "kaufen", "gekauft", "hat", "human"), THINGS, "acc"),
    (("reads", "read", "read", "liest", "lesen", "gelesen", "hat", "human"), READABLE, "acc"),
    (
        ("washes", "wash", "washed", "wäscht", "waschen", "gewaschen", "hat", "human"),
        ANIMALS + THINGS,
        "acc",
    ),
    # German objects of folgen / helfen are in the dative.
    (
        ("follows", "follow", "followed", "folgt", "folgen", "gefolgt", "ist", "any"),
        ANIMATES,
        "dat",
    ),
    (("helps", "help", "helped", "hilft", "helfen", "geholfen", "hat", "any"), ANIMATES, "dat"),
)
# Animals eat and drink with other German verbs than people.
ANIMAL_FORMS = {
    "eats": ("frisst", "fressen", "gefressen"),
    "drinks": ("säuft", "saufen", "gesoffen"),
}
MOTION = (
    ("runs", "run", "run", "läuft", "laufen", "gelaufen", "ist", "any"),
    ("jumps", "jump", "jumped", "springt", "springen", "gesprungen", "ist", "any"),
    ("swims", "swim", "swum", "schwimmt", "schwimmen", "geschwommen", "ist", "any"),
    ("walks", "walk", "walked", "geht", "gehen", "gegangen", "ist", "any"),
    ("crawls", "crawl", "crawled", "kriecht", "kriechen", "gekrochen", "ist", "any"),
    ("climbs", "climb", "climbed", "klettert", "klettern", "geklettert", "ist", "any"),
    ("drives", "drive", "driven", "fährt", "fahren", "gefahren", "ist", "human"),
)
STATIC = (
    ("sleeps", "sleep", "slept", "schläft", "schlafen", "geschlafen", "hat", "any"),
    ("waits", "wait", "waited", "wartet", "warten", "gewartet", "hat", "any"),
    ("sits", "sit", "sat", "sitzt", "sitzen", "gesessen", "hat", "any"),
    ("plays", "play", "played", "spielt", "spielen", "gespielt", "hat", "any"),
    ("stands", "stand", "stood", "steht", "stehen", "gestanden", "hat", "any"),
    ("sings", "sing", "sung", "singt", "singen", "gesungen", "hat", "human"),
    ("works", "work", "worked", "arbeitet", "arbeiten", "gearbeitet", "hat", "human"),
    ("laughs", "laugh", "laughed", "lacht", "lachen", "gelacht", "hat", "human"),
)
# Verbs taking a that-clause; "knows" is "weiß" here, "kennt" before a noun phrase.
THAT_VERBS = (
    ("knows", "know", "known", "weiß", "wissen", "gewusst", "hat", "human"),
    ("says", "say", "said", "sagt", "sagen", "gesagt", "hat", "human"),
    ("believes", "believe", "believed", "glaubt", "glauben", "geglaubt", "hat", "human"),
    ("hears", "hear", "heard", "hört", "hören", "gehört", "hat", "human"),
)
AUX = {"hat": ("has", "have", "hat", "haben"), "ist": ("has", "have", "ist", "sind")}
# "on" is auf/an by the place (PLACES); the others always the same word.
TWO_WAY = _pairs("in:in on:- under:unter behind:hinter next_to:neben in_front_of:vor above:über")
# (en, de, German case) for verbs of motion and for the others; "entlang" follows its noun.
MOTION_PREPS = (
    ("to", "zu", "dat"),
    ("through", "durch", "acc"),
    ("along", "entlang", "acc"),
    ("from", "von", "dat"),
)
OTHER_PREPS = (("with", "mit", "dat"), ("for", "für", "acc"), ("without", "ohne", "acc"))
CONTRACTIONS = {
    ("in", "dem"): "im",
    ("in", "das"): "ins",
    ("an", "dem"): "am",
    ("an", "das"): "ans",
    ("von", "dem"): "vom",
    ("zu", "dem"): "zum",
    ("zu", "der"): "zur",
}
TIMES = _pairs(
    "today:heute now:jetzt tomorrow:morgen often:oft always:immer sometimes:manchmal "
    "usually:meistens later:später again:wieder soon:bald"
)
SUB_CONJ = _pairs(
    "because:weil while:während although:obwohl if:wenn as_soon_as:sobald before:bevor"
)
MAIN_CONJ = _pairs("and:und but:aber or:oder")

DEF = {
    "nom": {"m": "der", "f": "die", "n": "das", "pl": "die"},
    "acc": {"m": "den", "f": "die", "n": "das", "pl": "die"},
    "dat": {"m": "dem", "f": "der", "n": "dem", "pl": "den"},
}
INDEF = {
    "nom": {"m": "ein", "f": "eine", "n": "ein"},
    "acc": {"m": "einen", "f": "eine", "n": "ein"},
    "dat": {"m": "einem", "f": "einer", "n": "einem"},
}
# Adjective endings: weak after der/die/das, mixed after ein/kein, strong with no article.
ENDINGS = {
    "weak": {
        "nom": {"m": "e", "f": "e", "n": "e", "pl": "en"},
        "acc": {"m": "en", "f": "e", "n": "e", "pl": "en"},
        "dat": {"m": "en", "f": "en", "n": "en", "pl": "en"},
    },
    "mixed": {
        "nom": {"m": "er", "f": "e", "n": "es", "pl": "en"},
        "acc": {"m": "en", "f": "e", "n": "es", "pl": "en"},
        "dat": {"m": "en", "f": "en", "n": "en", "pl": "en"},
    },
    "strong": {
        "nom": {"m": "er", "f": "e", "n": "es", "pl": "e"},
        "acc": {"m": "en", "f": "e", "n": "es", "pl": "e"},
        "dat": {"m": "em", "f": "er", "n": "em", "pl": "en"},
    },
}
ADJECTIVES_OF = {
    **{n[0]: ANIMATE_ADJ for n in ANIMATES},
    **{n[0]: THING_ADJ for n in THINGS},
    **{n[0]: DRINK_ADJ for n in DRINKS},
    **{n[0]: PLACE_ADJ for n in PLACES},
}


def _noun_phrase(rng: random.Random, nouns, case: str, negated: bool = False):
    """``(en words, de words, plural, absorbed)``: a noun phrase in ``case``; ``absorbed``
    when ``negated`` turned its indefinite article into ``kein``."""
    en_sg, en_pl, de_sg, de_pl, gender, oblique = rng.choice(nouns)[:6]
    mass = en_pl is None
    plural = not mass and rng.random() < 0.3
    definite = rng.random() < 0.55
    adjectives = rng.sample(ADJECTIVES_OF[en_sg], rng.choices((0, 1, 2), (0.45, 0.4, 0.15))[0])
    key = "pl" if plural else gender
    en_words = [a for a, _ in adjectives] + [en_pl if plural else en_sg]
    if definite:
        en_art, de_art, decl = ["the"], DEF[case][key], "weak"
    else:
        en_art = [] if plural or mass else ["an" if en_words[0][0] in "aeiou" else "a"]
        if negated:
            de_art = ("keinen" if case == "dat" else "keine") if plural else "k" + INDEF[case][key]
            decl = "mixed"
        elif plural or mass:
            de_art, decl = "", "strong"
        else:
            de_art, decl = INDEF[case][key], "mixed"
    de_words = []
    for _, stem in adjectives:
        ending = ENDINGS[decl][case][key]
        de_words.append(stem + (ending[1:] if stem.endswith("e") else ending))
    if plural:
        dative_n = case == "dat" and not de_pl.endswith(("n", "s"))
        de_words.append(de_pl + ("n" if dative_n else ""))
    else:
        de_words.append(oblique if oblique and case != "nom" else de_sg)
    absorbed = negated and not definite
    return en_art + en_words, ([de_art] if de_art else []) + de_words, plural, absorbed


def _prepositional_phrase(rng: random.Random, motion: bool) -> tuple[list[str], list[str]]:
    if rng.random() < 0.6:
        prep_en, prep_de = rng.choice(TWO_WAY)
        places = IN_PLACES if prep_en == "in" else ON_PLACES if prep_en == "on" else PLACES
        # Verbs of motion give a direction (accusative), the others a location (dative).
        case = "acc" if motion else "dat"
        noun = rng.choice(places)
        obj_en, obj_de, _, _ = _noun_phrase(rng, (noun,), case)
        if prep_en == "on":
            prep_de = noun[6]
    else:
        prep_en, prep_de, case = rng.choice(MOTION_PREPS if motion else OTHER_PREPS)
        pool = PLACES if motion else ANIMATES + THINGS if prep_en != "for" else ANIMATES
        obj_en, obj_de, _, _ = _noun_phrase(rng, pool, case)
    if prep_de == "entlang":
        return [prep_en, *obj_en], [*obj_de, prep_de]
    if (prep_de, obj_de[0]) in CONTRACTIONS:
        return [prep_en, *obj_en], [CONTRACTIONS[prep_de, obj_de[0]], *obj_de[1:]]
    return [prep_en, *obj_en], [prep_de, *obj_de]


def _clause(rng: random.Random, *, allow_that: bool, allow_time: bool = True) -> dict:
    """One clause: its English words and the German pieces that the word order arranges."""
    human = rng.random() < 0.5
    subj_en, subj_de, plural, _ = _noun_phrase(rng, HUMANS if human else ANIMALS, "nom")
    kind = rng.choices(("trans", "motion", "static", "that"), (0.45, 0.22, 0.21, 0.12))[0]
    if kind == "that" and not (allow_that and human):
        kind = "trans"
    if kind == "trans":
        verb, objects, obj_case = rng.choice([t for t in TRANSITIVE if human or t[0][7] == "any"])
    else:
        pool = {"motion": MOTION, "static": STATIC, "that": THAT_VERBS}[kind]
        verb = rng.choice([v for v in pool if human or v[7] == "any"])
    en3, en_base, en_part, de3, de_inf, de_part, aux, _ = verb
    if not human and en3 in ANIMAL_FORMS:
        de3, de_inf, de_part = ANIMAL_FORMS[en3]
    tense = rng.choices(("present", "perfect", "modal"), (0.5, 0.25, 0.25))[0]
    negated = rng.random() < 0.2
    num = 1 if plural else 0
    if tense == "present":
        en_verb = [("do", "does")[1 - num], "not", en_base] if negated else [(en3, en_base)[num]]
        fin, nonfin = (de3, de_inf)[num], []
    elif tense == "perfect":
        en_aux, en_aux_pl, de_aux, de_aux_pl = AUX[aux]
        en_verb = [(en_aux, en_aux_pl)[num], *(["not"] if negated else []), en_part]
        fin, nonfin = (de_aux, de_aux_pl)[num], [de_part]
    else:
        modal = rng.choice(("can", "must", "want"))
        if modal == "can":
            en_verb = ["cannot" if negated else "can", en_base]
            fin = ("kann", "können")[num]
        elif modal == "must":
            en_verb = ["must", *(["not"] if negated else []), en_base]
            # "must not" forbids: German "darf nicht", not "muss nicht".
            fin = (("darf", "dürfen") if negated else ("muss", "müssen"))[num]
        else:
            en_verb = [("wants", "want")[num], "to", en_base]
            if negated:
                en_verb = [("does", "do")[num], "not", "want", "to", en_base]
            fin = ("will", "wollen")[num]
        nonfin = [de_inf]
    en = subj_en + en_verb
    obj_de, tail, nicht = [], [], negated
    if kind == "trans":
        obj_en, obj_de, _, absorbed = _noun_phrase(rng, objects, obj_case, negated)
        en += obj_en
        nicht = negated and not absorbed
    elif kind == "that":
        inner = _clause(rng, allow_that=False)
        en += ["that", *inner["en"]]
        tail = [",", "dass", *subordinate(inner)]
    pp_en, pp_de = [], []
    if kind != "that" and rng.random() < (0.7 if kind == "motion" else 0.4):
        pp_en, pp_de = _prepositional_phrase(rng, kind == "motion")
    time_en, time_de = [], []
    if allow_time and kind != "that" and rng.random() < 0.15:
        time_en, time_de = (list(w) for w in zip(*[rng.choice(TIMES)]))
    return {
        "en": en + pp_en + time_en,
        "subj": subj_de,
        "fin": fin,
        # German middle field: time, object, nicht, place; then the verb's other parts.
        "middle": time_de + obj_de + (["nicht"] if nicht else []) + pp_de,
        "nonfin": nonfin,
        "tail": tail,
        "has_time": bool(time_en),
    }


def main_clause(c: dict, inverted: bool = False) -> list[str]:
    """Verb-second: subject first, or the finite verb first after a fronted element."""
    head = [c["fin"], *c["subj"]] if inverted else [*c["subj"], c["fin"]]
    return head + c["middle"] + c["nonfin"] + c["tail"]


def subordinate(c: dict) -> list[str]:
    """Verb-final: the finite verb after its other parts."""
    return c["subj"] + c["middle"] + c["nonfin"] + [c["fin"]] + c["tail"]


def generate_pair(rng: random.Random) -> tuple[str, str]:
    """One (English, German) sentence pair."""
    n_clauses = rng.choices((1, 2, 3), (0.35, 0.45, 0.2))[0]
    first = _clause(rng, allow_that=True)
    if n_clauses > 1 and rng.random() < 0.2:
        # A fronted subordinate clause takes the first place: the main clause inverts.
        conj_en, conj_de = rng.choice(SUB_CONJ)
        sub = _clause(rng, allow_that=False)
        en = [conj_en, *sub["en"], ",", *first["en"]]
        de = [conj_de, *subordinate(sub), ",", *main_clause(first, inverted=True)]
        n_clauses -= 1
    elif not first["has_time"] and rng.random() < 0.25:
        time_en, time_de = rng.choice(TIMES)
        en = [time_en, *first["en"]]
        de = [time_de, *main_clause(first, inverted=True)]
    else:
        en, de = first["en"], main_clause(first)
    for _ in range(n_clauses - 1):
        clause = _clause(rng, allow_that=True)
        if rng.random() < 0.5:
            conj_en, conj_de = rng.choice(SUB_CONJ)
            en += [conj_en, *clause["en"]]
            de += [",", conj_de, *subordinate(clause)]
        else:
            conj_en, conj_de = rng.choice(MAIN_CONJ)
            en += ([","] if conj_en == "but" else []) + [conj_en, *clause["en"]]
            de += ([","] if conj_de == "aber" else []) + [conj_de, *main_clause(clause)]
    return _detok(en), _detok(de)


def _detok(words: list[str]) -> str:
    return (" ".join(words) + ".").replace(" ,", ",")


def sentence_stats(sentences: list[str]) -> dict[str, float]:
    """Mean, median and maximum length in words (punctuation apart) of ``sentences``."""
    lengths = [len(s.replace(",", " ,").rstrip(".").split()) for s in sentences]
    return {
        "mean": statistics.fmean(lengths),
        "median": statistics.median(lengths),
        "max": max(lengths),
    }


def generate_split(
    seed: int, split: str, n: int, exclude: set[str] = frozenset()
) -> list[tuple[str, str]]:
    """``n`` distinct pairs from the stream of (seed, split), skipping English in ``exclude``."""
    rng = random.Random(f"macformer_lit-synthetic-translation-{seed}-{split}")
    seen: set[str] = set()
    pairs = []
    attempts = 0
    while len(pairs) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise RuntimeError(f"could not draw {n} distinct {split} sentences")
        en, de = generate_pair(rng)
        if en in seen or en in exclude:
            continue
        seen.add(en)
        pairs.append((en, de))
    return pairs


class SyntheticTranslationDataModule(TranslationDataModule):
    def __init__(
        self,
        *,
        data_dir: str = "data/synthetic_translation",
        src_lang: Literal["en", "de"] = "en",
        tgt_lang: Literal["en", "de"] = "de",
        train_size: int = 20000,
        val_size: int = 500,
        test_size: int = 1000,
        tokenizer_vocab_size: int = 1000,
        max_len: int = 96,
        batch_size: int = 64,
        bucket_by_length: bool = True,
        seed: int = 0,
        **translation: Any,
    ) -> None:
        """
        Args:
            data_dir: where the tokenizer is cached (the sentences are made in memory).
            src_lang: ``en`` (default) or ``de``.
            tgt_lang: the other one.
            train_size: sentence pairs generated for training.
            val_size: sentence pairs generated for validation.
            test_size: sentence pairs generated for testing.
            tokenizer_vocab_size: subword vocabulary size.
            max_len: tokens per sentence; the longest sentences take ~70 BPE tokens.
            batch_size: training batch size.
            bucket_by_length: batch sentences of similar length together.
            seed: the data stream; the same seed gives the same sentences.

        The other arguments are TranslationDataModule's and its base's, but for
        ``lowercase``: the generated sentences are used as they are.
        """
        if {src_lang, tgt_lang} != {"en", "de"}:
            raise ValueError(
                f"unknown language pair {src_lang}→{tgt_lang}; the synthetic task translates "
                "en→de or de→en"
            )
        for name, value in (
            ("train_size", train_size),
            ("val_size", val_size),
            ("test_size", test_size),
        ):
            if value is None:
                raise ValueError(f"{name} must be a positive integer; got None")
        super().__init__(
            data_dir=data_dir,
            src_lang=src_lang,
            tgt_lang=tgt_lang,
            train_size=train_size,
            val_size=val_size,
            test_size=test_size,
            tokenizer_vocab_size=tokenizer_vocab_size,
            max_len=max_len,
            batch_size=batch_size,
            bucket_by_length=bucket_by_length,
            seed=seed,
            lowercase=False,
            **translation,
        )
        self.build_vocabulary()

    def read_split(self, split: str) -> tuple[list[str], list[str]]:
        exclude: set[str] = set()
        if split != "train":
            src, tgt = self.split_texts("train")
            exclude = set(src if self.src_lang == "en" else tgt)
        pairs = generate_split(self.seed, split, self.sizes[split], exclude)
        en = [p[0] for p in pairs]
        de = [p[1] for p in pairs]
        return (en, de) if self.src_lang == "en" else (de, en)
