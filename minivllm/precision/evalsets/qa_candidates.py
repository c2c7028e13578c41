"""Candidate factual questions for the QA evaluation set, written for this project (CC0).

Each entry is (question, [accepted answers]). ``build.py`` asks the float32 reference
model every question and keeps those it answers correctly, so the set measures whether a
configuration *keeps* knowledge the model has, not the model's knowledge itself.
"""

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Japan", "Tokyo"), ("China", "Beijing"), ("Russia", "Moscow"), ("England", "London"),
    ("the United Kingdom", "London"), ("Egypt", "Cairo"), ("Greece", "Athens"),
    ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Austria", "Vienna"),
    ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"), ("Poland", "Warsaw"), ("Hungary", "Budapest"),
    ("the Czech Republic", "Prague"), ("Belgium", "Brussels"), ("the Netherlands", "Amsterdam"),
    ("Switzerland", "Bern"), ("Turkey", "Ankara"), ("India", "New Delhi"),
    ("South Korea", "Seoul"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"),
    ("Indonesia", "Jakarta"), ("the Philippines", "Manila"), ("Australia", "Canberra"),
    ("New Zealand", "Wellington"), ("Canada", "Ottawa"), ("the United States", "Washington"),
    ("Mexico", "Mexico City"), ("Brazil", "Brasilia"), ("Argentina", "Buenos Aires"),
    ("Peru", "Lima"), ("Chile", "Santiago"), ("Colombia", "Bogota"), ("Cuba", "Havana"),
    ("Kenya", "Nairobi"), ("Nigeria", "Abuja"), ("Ethiopia", "Addis Ababa"),
    ("Morocco", "Rabat"), ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("Israel", "Jerusalem"),
    ("Saudi Arabia", "Riyadh"), ("Pakistan", "Islamabad"), ("Afghanistan", "Kabul"),
    ("Ukraine", "Kyiv"), ("Romania", "Bucharest"), ("Bulgaria", "Sofia"),
    ("Serbia", "Belgrade"), ("Croatia", "Zagreb"), ("Iceland", "Reykjavik"),
    ("Scotland", "Edinburgh"), ("Wales", "Cardiff"), ("Malaysia", "Kuala Lumpur"),
    ("Singapore", "Singapore"), ("Venezuela", "Caracas"), ("Syria", "Damascus"),
    ("Lebanon", "Beirut"), ("Jordan", "Amman"), ("Qatar", "Doha"), ("Nepal", "Kathmandu"),
    ("Bangladesh", "Dhaka"), ("Sri Lanka", "Colombo"), ("Mongolia", "Ulaanbaatar"),
]

LANGUAGES = [
    ("France", "French"), ("Germany", "German"), ("Spain", "Spanish"), ("Italy", "Italian"),
    ("Japan", "Japanese"), ("China", "Chinese", "Mandarin"), ("Russia", "Russian"),
    ("Portugal", "Portuguese"), ("Brazil", "Portuguese"), ("Mexico", "Spanish"),
    ("Greece", "Greek"), ("Turkey", "Turkish"), ("Poland", "Polish"), ("Sweden", "Swedish"),
    ("the Netherlands", "Dutch"), ("South Korea", "Korean"), ("Egypt", "Arabic"),
    ("England", "English"), ("Australia", "English"), ("Argentina", "Spanish"),
    ("Finland", "Finnish"), ("Norway", "Norwegian"), ("Hungary", "Hungarian"),
    ("Thailand", "Thai"), ("Vietnam", "Vietnamese"),
]

CURRENCIES = [
    ("Japan", "yen"), ("the United States", "dollar"), ("the United Kingdom", "pound"),
    ("India", "rupee"), ("China", "yuan", "renminbi"), ("Russia", "ruble", "rouble"),
    ("Mexico", "peso"), ("Switzerland", "franc"), ("South Korea", "won"),
    ("Germany", "euro"), ("France", "euro"), ("Italy", "euro"), ("Brazil", "real"),
    ("Canada", "dollar"), ("Australia", "dollar"), ("Sweden", "krona"),
]

AUTHORS = [
    ("Romeo and Juliet", "Shakespeare"), ("Hamlet", "Shakespeare"), ("Macbeth", "Shakespeare"),
    ("Pride and Prejudice", "Austen"), ("Harry Potter", "Rowling"),
    ("The Origin of Species", "Darwin"), ("War and Peace", "Tolstoy"),
    ("Don Quixote", "Cervantes"), ("Oliver Twist", "Dickens"),
    ("A Christmas Carol", "Dickens"), ("The Adventures of Tom Sawyer", "Twain"),
    ("Nineteen Eighty-Four", "Orwell"), ("Animal Farm", "Orwell"),
    ("The Odyssey", "Homer"), ("The Iliad", "Homer"), ("Frankenstein", "Shelley"),
    ("The Hobbit", "Tolkien"), ("The Lord of the Rings", "Tolkien"),
    ("Sherlock Holmes", "Conan Doyle", "Doyle"), ("Moby-Dick", "Melville"),
]

SCIENCE = [
    ("Which planet is known as the Red Planet?", ["Mars"]),
    ("What is the largest planet in our solar system?", ["Jupiter"]),
    ("What is the closest star to the Earth?", ["Sun"]),
    ("What is the chemical symbol for gold?", ["Au"]),
    ("What is the chemical symbol for iron?", ["Fe"]),
    ("What is the chemical symbol for sodium?", ["Na"]),
    ("What is the chemical symbol for oxygen?", ["O"]),
    ("What is the chemical formula for water?", ["H2O"]),
    ("What gas do plants absorb from the air for photosynthesis?", ["carbon dioxide", "CO2"]),
    ("What gas do humans need to breathe to survive?", ["oxygen"]),
    ("At what temperature in degrees Celsius does water boil at sea level?", ["100"]),
    ("At what temperature in degrees Celsius does water freeze?", ["0", "zero"]),
    ("What is the hardest natural substance?", ["diamond"]),
    ("What organ pumps blood through the human body?", ["heart"]),
    ("What is the largest organ of the human body?", ["skin"]),
    ("How many bones are in the adult human body?", ["206"]),
    ("What force keeps us on the ground?", ["gravity"]),
    ("What is the center of an atom called?", ["nucleus"]),
    ("What particle has a negative electric charge?", ["electron"]),
    ("Who developed the theory of relativity?", ["Einstein"]),
    ("Who discovered penicillin?", ["Fleming"]),
    ("Who proposed the laws of motion and universal gravitation?", ["Newton"]),
    ("What is the speed of light in kilometers per second, approximately?", ["300,000", "300000", "299,792", "299792"]),
    ("What planet is closest to the Sun?", ["Mercury"]),
    ("What is the name of our galaxy?", ["Milky Way"]),
    ("What is the natural satellite of the Earth called?", ["Moon"]),
    ("What do bees make?", ["honey"]),
    ("What is the largest ocean on Earth?", ["Pacific"]),
    ("What is the longest river in Africa?", ["Nile"]),
    ("What is the tallest mountain in the world?", ["Everest"]),
    ("What is the largest desert in Africa?", ["Sahara"]),
    ("Which continent is Egypt in?", ["Africa"]),
    ("Which continent is Brazil in?", ["South America"]),
    ("Which continent is Japan in?", ["Asia"]),
    ("How many continents are there on Earth?", ["seven", "7"]),
    ("What is the freezing point of water in degrees Fahrenheit?", ["32"]),
    ("What is the main gas in the Earth's atmosphere?", ["nitrogen"]),
    ("What kind of animal is a whale?", ["mammal"]),
    ("What is the largest animal on Earth?", ["blue whale"]),
    ("What is the fastest land animal?", ["cheetah"]),
    ("What is the tallest animal?", ["giraffe"]),
]

EVERYDAY = [
    ("What color is the sky on a clear day?", ["blue"]),
    ("What color is grass?", ["green"]),
    ("What color is snow?", ["white"]),
    ("What color is a ripe banana?", ["yellow"]),
    ("What color is a ripe tomato?", ["red"]),
    ("What color do you get by mixing blue and yellow?", ["green"]),
    ("What color do you get by mixing red and white?", ["pink"]),
    ("How many legs does a spider have?", ["eight", "8"]),
    ("How many legs does an insect have?", ["six", "6"]),
    ("How many legs does a dog have?", ["four", "4"]),
    ("How many days are in a week?", ["seven", "7"]),
    ("How many months are in a year?", ["twelve", "12"]),
    ("How many hours are in a day?", ["24", "twenty-four", "twenty four"]),
    ("How many minutes are in an hour?", ["60", "sixty"]),
    ("How many seconds are in a minute?", ["60", "sixty"]),
    ("How many days are in a leap year?", ["366"]),
    ("How many sides does a triangle have?", ["three", "3"]),
    ("How many sides does a square have?", ["four", "4"]),
    ("How many sides does a hexagon have?", ["six", "6"]),
    ("How many sides does an octagon have?", ["eight", "8"]),
    ("What animal says moo?", ["cow"]),
    ("What animal says meow?", ["cat"]),
    ("What animal barks?", ["dog"]),
    ("What is the young of a cat called?", ["kitten"]),
    ("What is the young of a dog called?", ["puppy"]),
    ("What is frozen water called?", ["ice"]),
    ("What do we call the meal eaten in the morning?", ["breakfast"]),
    ("Which season comes after winter?", ["spring"]),
    ("Which season comes after summer?", ["autumn", "fall"]),
    ("What is the opposite of hot?", ["cold"]),
    ("What is the opposite of up?", ["down"]),
    ("What is the opposite of big?", ["small", "little"]),
    ("What is the opposite of fast?", ["slow"]),
    ("What is the opposite of day?", ["night"]),
    ("What is the opposite of happy?", ["sad", "unhappy"]),
    ("What is the opposite of black?", ["white"]),
    ("What is the opposite of open?", ["closed", "close", "shut"]),
    ("What is the opposite of full?", ["empty"]),
    ("What is the opposite of old?", ["young", "new"]),
    ("What is the opposite of left?", ["right"]),
    ("What is the opposite of light?", ["dark", "heavy"]),
    ("What is the plural of mouse?", ["mice"]),
    ("What is the plural of child?", ["children"]),
    ("What is the plural of tooth?", ["teeth"]),
    ("What is the plural of foot?", ["feet"]),
    ("What is the past tense of go?", ["went"]),
    ("What is the past tense of eat?", ["ate"]),
    ("What is the past tense of see?", ["saw"]),
]

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight",
                "nine", "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen",
                "sixteen", "seventeen", "eighteen", "nineteen", "twenty"]


def candidates() -> list[tuple[str, str, list[str]]]:
    """All candidate items as (category, question, accepted answers)."""
    out: list[tuple[str, str, list[str]]] = []
    for country, city in CAPITALS:
        out.append(("capital", f"What is the capital of {country}?", [city]))
    for country, *langs in LANGUAGES:
        out.append(("language", f"What is the main language spoken in {country}?", list(langs)))
    for country, *cur in CURRENCIES:
        out.append(("currency", f"What is the currency of {country}?", list(cur)))
    for book, *author in AUTHORS:
        out.append(("author", f"Who wrote {book}?", list(author)))
    for q, answers in SCIENCE:
        out.append(("science", q, answers))
    for q, answers in EVERYDAY:
        out.append(("everyday", q, answers))
    for i, d in enumerate(DAYS):
        out.append(("calendar", f"What day comes after {d}?", [DAYS[(i + 1) % 7]]))
    for i, m in enumerate(MONTHS):
        out.append(("calendar", f"What month comes after {m}?", [MONTHS[(i + 1) % 12]]))
    for a in range(1, 10):
        for b in (1, 2, 3):
            s = a + b
            out.append(("arithmetic", f"What is {a} plus {b}?", [str(s), NUMBER_WORDS[s]]))
    return out
