"""Chat prompts for training and measuring the default SmolLM2 draft, written programmatically (no downloads).

Templates (what is asked) are crossed with subjects (what it is about). The held-out split is by
SUBJECT: a held-out prompt's subject never appears in any training prompt, so acceptance measured on
it is not memorised text. A few hand-written questions are held out as well.
"""

from __future__ import annotations

import hashlib
import random

# (template, kind): kind picks which subject list fills {x}.
TEMPLATES: list[tuple[str, str]] = [
    ("What is {x}?", "thing"),
    ("Explain {x} in simple terms.", "thing"),
    ("Can you tell me about {x}?", "thing"),
    ("Give me three interesting facts about {x}.", "thing"),
    ("Write a short poem about {x}.", "thing"),
    ("Describe {x} to a ten-year-old.", "thing"),
    ("What are the advantages and disadvantages of {x}?", "thing"),
    ("Write a haiku about {x}.", "thing"),
    ("Summarize what you know about {x} in two sentences.", "thing"),
    ("Why is {x} important?", "thing"),
    ("Write a short story that involves {x}.", "thing"),
    ("List five words related to {x}.", "thing"),
    ("How would you explain {x} to someone who has never heard of it?", "thing"),
    ("What is the history of {x}?", "thing"),
    ("Tell me a fun fact about {x}.", "thing"),
    ("How do I {x}?", "task"),
    ("Give me step-by-step instructions to {x}.", "task"),
    ("What is the best way to {x}?", "task"),
    ("What are some tips to {x}?", "task"),
    ("What mistakes should I avoid when I try to {x}?", "task"),
    ("What is the capital of {x}?", "place"),
    ("What is {x} famous for?", "place"),
    ("What language do people speak in {x}?", "place"),
    ("Plan a three-day trip to {x}.", "place"),
    ("What is the weather like in {x}?", "place"),
    ("Write a Python function that {x}.", "code"),
    ("How can I write a program that {x}?", "code"),
    ("Show me JavaScript code that {x}.", "code"),
    ("What is {a} plus {b}?", "math"),
    ("What is {a} times {b}?", "math"),
    ("If I have {a} apples and give away {b}, how many are left?", "math"),
    ("Is {a} a prime number?", "math"),
    ("What is {a} divided by {b}?", "math"),
    ("Who was {x}?", "person"),
    ("What did {x} discover or create?", "person"),
    ("Write a short biography of {x}.", "person"),
    ("Compare {x} and {y}.", "pair"),
    ("What is the difference between {x} and {y}?", "pair"),
    ("Which is better, {x} or {y}?", "pair"),
    ("Translate '{x}' into French.", "phrase"),
    ("Translate '{x}' into Spanish.", "phrase"),
    ("Correct the grammar of this sentence: '{x}'", "phrase"),
    ("Rewrite this sentence to sound more formal: '{x}'", "phrase"),
    ("What does this sentence mean: '{x}'?", "phrase"),
]

# More templates, crossed with the same subjects, so the replies double without a new
# held-out split. Their prompts are APPENDED to the training list (the first 3,260 keep their order,
# so earlier reply chunks stay valid), and those with a held-out subject are dropped, not held out
# (the held-out list, and every acceptance figure measured on it, stays the same).
MORE_TEMPLATES: list[tuple[str, str]] = [
    ("What are some common myths about {x}?", "thing"),
    ("Explain {x} using an everyday analogy.", "thing"),
    ("Write a short dialogue between two friends talking about {x}.", "thing"),
    ("What would the world be like without {x}?", "thing"),
    ("Teach me the basics of {x}.", "thing"),
    ("Write a tweet about {x}.", "thing"),
    ("What questions do children often ask about {x}?", "thing"),
    ("Describe {x} in one paragraph.", "thing"),
    ("How has {x} changed over time?", "thing"),
    ("Write a quiz question about {x} and give the answer.", "thing"),
    ("What is a surprising thing most people do not know about {x}?", "thing"),
    ("Write the opening lines of a blog post about {x}.", "thing"),
    ("What are the main parts or ideas of {x}?", "thing"),
    ("Give me a simple example that shows {x}.", "thing"),
    ("I want to {x}. Where should I start?", "task"),
    ("Explain how to {x} in three steps.", "task"),
    ("How long does it take to {x}?", "task"),
    ("What do I need to {x}?", "task"),
    ("Why is it hard to {x}?", "task"),
    ("Give me a checklist to {x}.", "task"),
    ("My friend wants to {x}. What advice should I give?", "task"),
    ("What food is {x} known for?", "place"),
    ("Tell me about the history of {x}.", "place"),
    ("What are the top places to visit in {x}?", "place"),
    ("Describe a typical day in {x}.", "place"),
    ("Write a short poem about {x}.", "place"),
    ("What should a tourist know before visiting {x}?", "place"),
    ("Explain the code for a function that {x}, line by line.", "code"),
    ("Write a C function that {x}.", "code"),
    ("What is the simplest way to write a program that {x}?", "code"),
    ("Write a Python class with a method that {x}.", "code"),
    ("Why is {x} famous?", "person"),
    ("What can we learn from {x}?", "person"),
    ("Write a short poem about {x}.", "person"),
    ("Give me three facts about {x}.", "person"),
    ("Describe the life of {x} for a child.", "person"),
    ("Translate '{x}' into German.", "phrase"),
    ("Translate '{x}' into Italian.", "phrase"),
    ("Make this sentence sound friendlier: '{x}'", "phrase"),
    ("Write a short conversation that starts with: '{x}'", "phrase"),
    ("What is {a} minus {b}?", "math"),
    ("What is {a} squared plus {b}?", "math"),
    ("A box holds {a} pencils. How many pencils are in {b} boxes?", "math"),
]

THINGS = """photosynthesis; the water cycle; gravity; black holes; the moon; volcanoes; earthquakes; rainbows;
the internet; electricity; magnets; the human heart; the brain; DNA; vaccines; bacteria; viruses;
climate change; recycling; solar energy; wind power; nuclear energy; the ocean; coral reefs; rainforests;
deserts; glaciers; the solar system; Mars; Jupiter; the sun; stars; galaxies; atoms; molecules;
chemistry; physics; biology; mathematics; algebra; geometry; fractions; prime numbers; statistics;
machine learning; artificial intelligence; computers; smartphones; the printing press; the wheel;
democracy; money; banks; inflation; taxes; the stock market; music; jazz; classical music; painting;
poetry; novels; theatre; movies; photography; chess; football; basketball; the Olympic Games; yoga;
meditation; sleep; exercise; healthy eating; vegetables; coffee; tea; chocolate; bread; cheese; pizza;
dogs; cats; elephants; dolphins; bees; butterflies; birds; sharks; penguins; dinosaurs; trees;
flowers; mushrooms; friendship; kindness; honesty; happiness; time management; leadership;
teamwork; public speaking; libraries; museums; schools; universities; the Roman Empire; ancient Egypt;
the pyramids; the Great Wall of China; the Renaissance; the Industrial Revolution; airplanes; trains;
bicycles; cars; rockets; satellites; the telescope; the microscope; batteries; plastic; glass; steel;
cotton; rivers; mountains; islands; snow; thunderstorms; tornadoes; hurricanes; the seasons;
calendars; clocks; maps; languages; writing; alphabets; emojis; video games; social media; email;
passwords; encryption; robots; 3D printing; electric cars; bridges; skyscrapers; gardens; farming;
fishing; cooking; baking; birthdays; holidays; weddings; kites; origami; knitting; the violin; the piano;
guitars; drums; opera; ballet; comic books; fairy tales; myths; dragons; pirates; castles; knights""".split(";")

TASKS = """learn a new language; bake bread at home; start running; save money; write a good essay;
improve my memory; fall asleep faster; make new friends; learn to code; cook rice; plant a tree;
study for an exam; prepare for a job interview; write a resume; reduce stress; keep a houseplant alive;
train a puppy; make a paper airplane; change a flat tire; make pancakes; organize my desk;
learn to play the guitar; draw a cat; start a small business; write a thank-you note; be more productive;
speak in public; take better photos; read more books; drink more water; clean a laptop keyboard;
make a budget; paint a room; learn to swim; ride a bicycle; brew coffee; make a smoothie; fold a shirt;
set up a fish tank; grow tomatoes; write a poem; tell a good story; stay focused; wake up early;
make a website; back up my files; choose a good password; learn chess; meditate; make lemonade;
sew a button; pack for a trip; write an email to my teacher; introduce myself; give a compliment;
apologize to a friend; recycle batteries; compost food scraps; make a snowman; build a birdhouse""".split(";")

PLACES = """France; Germany; Italy; Spain; Portugal; Japan; China; India; Brazil; Canada; Mexico; Egypt;
Kenya; Nigeria; Australia; New Zealand; Argentina; Chile; Peru; Russia; Norway; Sweden; Finland;
Denmark; Poland; Greece; Turkey; Thailand; Vietnam; Indonesia; South Korea; Ireland; Scotland;
the Netherlands; Belgium; Switzerland; Austria; Morocco; South Africa; Iceland; Cuba; Colombia;
Paris; London; Tokyo; Rome; New York; Sydney; Cairo; Berlin; Madrid; Istanbul; Venice; Kyoto""".split(";")

CODE = """adds two numbers; reverses a string; checks if a number is even; finds the largest number in a list;
counts the vowels in a string; sorts a list of names; computes the factorial of a number;
prints the Fibonacci sequence; checks if a word is a palindrome; converts Celsius to Fahrenheit;
removes duplicates from a list; counts words in a sentence; finds the average of a list;
checks if a year is a leap year; returns the square of a number; joins two lists; capitalizes every word;
finds the smallest element of an array; reads a file line by line; prints a multiplication table;
generates a random password; checks if a number is prime; merges two dictionaries; flattens a nested list;
calculates the area of a circle; converts a string to uppercase; counts how often each letter appears""".split(";")

PEOPLE = """Albert Einstein; Isaac Newton; Marie Curie; Charles Darwin; Leonardo da Vinci; William Shakespeare;
Mozart; Beethoven; Galileo Galilei; Ada Lovelace; Alan Turing; Nikola Tesla; Thomas Edison;
Abraham Lincoln; Napoleon; Cleopatra; Julius Caesar; Aristotle; Plato; Socrates; Confucius;
Jane Austen; Charles Dickens; Mark Twain; Vincent van Gogh; Pablo Picasso; Frida Kahlo;
Nelson Mandela; Mahatma Gandhi; Martin Luther King Jr.; Florence Nightingale; Louis Pasteur;
the Wright brothers; Neil Armstrong; Amelia Earhart; Johann Gutenberg; Archimedes; Pythagoras""".split(";")

PAIRS = """cats; dogs; tea; coffee; summer; winter; books; movies; trains; planes; the sun; the moon;
Python; JavaScript; rivers; lakes; cities; villages; running; swimming; apples; oranges; email; letters;
laptops; tablets; frogs; toads; weather; climate; viruses; bacteria; stars; planets; oceans; seas""".split(";")

PHRASES = """Good morning, how are you?; I would like a cup of tea, please.; Where is the train station?;
The weather is nice today.; Thank you for your help.; I am learning to cook.; My brother likes football.;
She go to school every day.; They was very happy yesterday.; I has two cats and a dog.;
We are going to the beach tomorrow.; Can you help me find my keys?; The book is on the table.;
I love reading in the evening.; How much does this cost?; It is raining outside.;
Please close the door.; The children are playing in the park.; I need to buy some bread.;
What time does the store open?; He don't like vegetables.; Me and him went to the store.""".split(";")

# Held out by hand: never generated from the templates above.
EXTRA_HELDOUT = [
    "What is the capital of France?",
    "Hello! Who are you?",
    "Write a limerick about a cat who loves pizza.",
    "What are the primary colors?",
    "How many days are in a leap year?",
    "Suggest a name for a bakery.",
    "What should I eat for breakfast?",
    "Give me a motivational quote and explain it.",
]

KINDS = {"thing": THINGS, "task": TASKS, "place": PLACES, "code": CODE, "person": PEOPLE, "phrase": PHRASES}


def _clean(items: list[str]) -> list[str]:
    return [" ".join(s.split()) for s in items if s.strip()]


def _heldout_subject(subject: str, percent: int) -> bool:
    """Stable by-subject split (a hash, never the list order)."""
    return int.from_bytes(hashlib.sha256(subject.encode()).digest()[:4], "little") % 100 < percent


def _crossed(templates: list[tuple[str, str]], rng: random.Random, heldout_percent: int) -> tuple[set[str], set[str]]:
    """(train, held-out) prompts of templates crossed with their subject lists, split by subject."""
    train: set[str] = set()
    heldout: set[str] = set()
    for template, kind in templates:
        if kind == "math":
            for _ in range(24):
                a, b = rng.randint(2, 99), rng.randint(2, 60)
                text = template.format(a=a, b=b)
                (heldout if _heldout_subject(f"{a}|{b}", heldout_percent) else train).add(text)
            continue
        if kind == "pair":
            items = _clean(PAIRS)
            for i in range(0, len(items) - 1, 2):
                x, y = items[i], items[i + 1]
                (heldout if _heldout_subject(x, heldout_percent) else train).add(template.format(x=x, y=y))
            continue
        for subject in _clean(KINDS[kind]):
            (heldout if _heldout_subject(subject, heldout_percent) else train).add(template.format(x=subject))
    return train, heldout


def build_prompts(seed: int = 0, heldout_percent: int = 12) -> tuple[list[str], list[str]]:
    """(train, held-out) prompt lists, deterministic for a seed; no held-out subject occurs in train.

    Train is the TEMPLATES prompts (shuffled) followed by the MORE_TEMPLATES ones (shuffled).
    """
    rng = random.Random(seed)
    train, heldout = _crossed(TEMPLATES, rng, heldout_percent)
    heldout |= set(EXTRA_HELDOUT)
    train_list, heldout_list = sorted(train - heldout), sorted(heldout)
    rng.shuffle(train_list)
    rng.shuffle(heldout_list)
    more, _ = _crossed(MORE_TEMPLATES, rng, heldout_percent)  # held-out subjects' prompts are dropped
    more_list = sorted(more - heldout - set(train_list))
    rng.shuffle(more_list)
    return train_list + more_list, heldout_list

if __name__ == "__main__":
    tr, ho = build_prompts()
    print(len(tr), len(ho))
    print(tr[:10])
    print(ho[:10])
