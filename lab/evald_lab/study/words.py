"""Real English words for the letter-counting questions of the accuracy study.

Written out here (no downloads): everyday words of 3 to 12 letters, many with repeated letters
(``strawberry``, ``mississippi``, ``bookkeeper``), where a subword model cannot read the count
off its tokens. Lower case ASCII only, no duplicates (a test checks both).
"""

from __future__ import annotations

__all__ = ["STUDY_WORDS"]

# fmt: off
STUDY_WORDS: tuple[str, ...] = (
    "strawberry", "banana", "mississippi", "bookkeeper", "committee", "balloon", "coffee",
    "success", "address", "assessment", "possession", "parallel", "millennium", "accommodate",
    "embarrass", "occurrence", "necessary", "tomorrow", "apple", "letter", "pepper", "puppet",
    "butter", "summer", "hammer", "bubble", "giraffe", "cinnamon", "broccoli", "zucchini",
    "spaghetti", "raspberry", "blueberry", "cherry", "grapefruit", "pineapple", "avocado",
    "tomato", "potato", "carrot", "cucumber", "lettuce", "cabbage", "mushroom", "onion",
    "garlic", "lemon", "orange", "mango", "papaya", "coconut", "peanut", "walnut", "almond",
    "chocolate", "vanilla", "caramel", "biscuit", "sandwich", "noodle", "pretzel", "popcorn",
    "elephant", "alligator", "crocodile", "kangaroo", "penguin", "dolphin", "octopus",
    "squirrel", "rabbit", "hippopotamus", "rhinoceros", "cheetah", "gorilla", "zebra",
    "buffalo", "raccoon", "hedgehog", "parrot", "peacock", "flamingo", "butterfly",
    "grasshopper", "mosquito", "caterpillar", "scorpion", "turtle", "tortoise", "lobster",
    "jellyfish", "seahorse", "pelican", "sparrow", "woodpecker", "hummingbird", "owl",
    "computer", "keyboard", "telephone", "television", "umbrella", "calendar", "notebook",
    "pencil", "scissors", "envelope", "blanket", "pillow", "mattress", "bathroom", "kitchen",
    "cupboard", "doorbell", "staircase", "balcony", "chimney", "basement", "library",
    "hospital", "pharmacy", "restaurant", "supermarket", "stadium", "airport", "harbor",
    "mountain", "volcano", "waterfall", "desert", "island", "peninsula", "forest", "jungle",
    "meadow", "valley", "canyon", "glacier", "river", "ocean", "lagoon", "horizon",
    "thunder", "lightning", "rainbow", "tornado", "hurricane", "blizzard", "weather",
    "sunshine", "moonlight", "planet", "galaxy", "universe", "satellite", "astronaut",
    "telescope", "microscope", "molecule", "electricity", "magnet", "battery", "engine",
    "bicycle", "motorcycle", "airplane", "helicopter", "submarine", "railway", "tunnel",
    "bridge", "traffic", "passenger", "luggage", "passport", "journey", "adventure",
    "treasure", "pirate", "castle", "kingdom", "princess", "dragon", "wizard", "giant",
    "mirror", "window", "curtain", "carpet", "ceiling", "garden", "flower", "sunflower",
    "tulip", "daffodil", "blossom", "cactus", "bamboo", "willow", "acorn", "pebble",
    "marble", "crystal", "diamond", "emerald", "sapphire", "silver", "copper", "bronze",
    "yellow", "purple", "scarlet", "turquoise", "lavender", "beige", "happiness", "freedom",
    "kindness", "patience", "courage", "wisdom", "honesty", "friendship", "knowledge",
    "language", "grammar", "vocabulary", "sentence", "paragraph", "question", "answer",
    "difference", "beginning", "different", "referral", "assassin", "tennessee",
    "llama", "aardvark", "bookshelf", "cookbook", "footprint", "raccoons", "goose",
    "kayak", "level", "radar", "rotator", "abracadabra",
    "onomatopoeia", "strength", "rhythm", "queue", "quiz", "jazz", "fizz", "buzz",
    "puzzle", "dazzle", "shell", "hello", "yellowish", "cheese", "freeze", "breeze",
    "sleeve", "teeth", "needle", "beetle", "referee", "agreement", "excellent",
    "engineer", "volunteer", "employee", "guarantee", "settee",
)
# fmt: on
