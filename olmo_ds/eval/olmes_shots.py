"""OLMES's curated in-context examples: the 5 solved questions that precede every question of a task.

OLMES fixes them per task (Gu et al. 2024): examples curated by hand from the task's training data, the
same ones in the same order before every question. oe-eval keeps them as its few-shot sources
`OLMES:<task>` (oe_eval/tasks/fewshot_sources.py; up to 10 per task) and takes the first `num_shots` (5).
These are those first five, as rows in the layout of the dataset we evaluate (the repo `OlmesTask.repo`
names), so `olmes.build_task` reads them like any other row. Two conversions from oe-eval's lists: BoolQ's
rows there are in SuperGLUE's layout (`label` 1 = true) and here in google/boolq's (`answer`: bool); fields
the task never reads (hellaswag's `ctx`, `split`, ...) are left out.

MMLU has no entry: OLMES takes the first 5 rows of each subject's `dev` split, read with the data.

The text is the datasets' own, typos and double spaces included (they are what the model is shown).
"""

from __future__ import annotations


def _choices(answer: str, *texts: str, labels: str = "ABCDE") -> dict:
    """ARC / OpenBookQA / CommonsenseQA: `choices: {text, label}` and the gold label as `answerKey`."""
    return {"choices": {"text": list(texts), "label": list(labels[: len(texts)])}, "answerKey": answer}


def _arc(id: str, question: str, answer: str, *texts: str, labels: str = "ABCDE") -> dict:
    return {"id": id, "question": question, **_choices(answer, *texts, labels=labels)}


def _obqa(id: str, stem: str, answer: str, *texts: str) -> dict:
    return {"id": id, "question_stem": stem, **_choices(answer, *texts)}


def _boolq(question: str, answer: bool, passage: str) -> dict:
    return {"question": question, "answer": answer, "passage": passage}


def _hellaswag(ind: int, source_id: str, activity_label: str, ctx_a: str, ctx_b: str, label: str, *endings: str) -> dict:
    return {"ind": ind, "source_id": source_id, "activity_label": activity_label, "ctx_a": ctx_a, "ctx_b": ctx_b,
            "endings": list(endings), "label": label}


def _piqa(goal: str, sol1: str, sol2: str, label: int) -> dict:
    return {"goal": goal, "sol1": sol1, "sol2": sol2, "label": label}


def _siqa(context: str, question: str, a: str, b: str, c: str, label: str) -> dict:
    return {"context": context, "question": question, "answerA": a, "answerB": b, "answerC": c, "label": label}


def _winogrande(sentence: str, option1: str, option2: str, answer: str) -> dict:
    return {"sentence": sentence, "option1": option1, "option2": option2, "answer": answer}


SHOTS: dict[str, list[dict]] = {
    "arc_easy": [
        _arc("MCAS_2007_8_5189", "Lichens are symbiotic organisms made of green algae and fungi. What do the green algae supply "
             "to the fungi in this symbiotic relationship?", "B", "carbon dioxide", "food", "protection", "water"),
        _arc("Mercury_SC_401169", "When a switch is used in an electrical circuit, the switch can", "D",
             "cause the charge to build.", "increase and decrease the voltage.", "cause the current to change direction.",
             "stop and start the flow of current."),
        _arc("MCAS_2004_8_27", "Which of the following is an example of an assistive device?", "A",
             "contact lens", "motorcycle", "raincoat", "coffee pot"),
        _arc("NYSEDREGENTS_2006_8_10", "Rocks are classified as igneous, metamorphic, or sedimentary according to", "3",
             "their color", "their shape", "how they formed", "the minerals they contain", labels="1234"),
        _arc("Mercury_7013388", "A chewable calcium carbonate tablet is a common treatment for stomach discomfort. Calcium "
             "carbonate is most likely used as this type of medicine because calcium carbonate", "C",
             "has a pleasant flavor.", "is inexpensive to produce.", "neutralizes digestive acid.", "occurs naturally in the body."),
    ],
    "arc_challenge": [
        _arc("Mercury_SC_415702", "George wants to warm his hands quickly by rubbing them. Which skin surface will produce the "
             "most heat?", "A", "dry palms", "wet palms", "palms covered with oil", "palms covered with lotion"),
        _arc("MCAS_2009_5_6516", "Which of the following statements best explains why magnets usually stick to a refrigerator "
             "door?", "B", "The refrigerator door is smooth.", "The refrigerator door contains iron.",
             "The refrigerator door is a good conductor.", "The refrigerator door has electric wires in it."),
        _arc("Mercury_7233695", "A fold observed in layers of sedimentary rock most likely resulted from the", "B",
             "cooling of flowing magma.", "converging of crustal plates.", "deposition of river sediments.",
             "solution of carbonate minerals."),
        _arc("Mercury_7041615", "Which of these do scientists offer as the most recent explanation as to why many plants and "
             "animals died out at the end of the Mesozoic era?", "D", "worldwide disease", "global mountain building",
             "rise of mammals that preyed upon plants and animals", "impact of an asteroid created dust that blocked the sunlight"),
        _arc("MCAS_1998_4_3", "Which of the following is a trait that a dog does NOT inherit from its parents?", "C",
             "the length of its fur", "the shape of its nose", "the size of its appetite", "the color of its fur"),
    ],
    "boolq": [
        _boolq("do iran and afghanistan speak the same language", True,
               "Persian language -- Persian (/ˈpɜːrʒən, -ʃən/), also known by its endonym Farsi (فارسی fārsi (fɒːɾˈsiː) ( listen)), "
               "is one of the Western Iranian languages within the Indo-Iranian branch of the Indo-European language family. It is "
               "primarily spoken in Iran, Afghanistan (officially known as Dari since 1958), and Tajikistan (officially known as "
               "Tajiki since the Soviet era), and some other regions which historically were Persianate societies and considered "
               "part of Greater Iran. It is written in the Persian alphabet, a modified variant of the Arabic script, which itself "
               "evolved from the Aramaic alphabet."),
        _boolq("do good samaritan laws protect those who help at an accident", True,
               "Good Samaritan law -- Good Samaritan laws offer legal protection to people who give reasonable assistance to those "
               "who are, or who they believe to be, injured, ill, in peril, or otherwise incapacitated. The protection is intended "
               "to reduce bystanders' hesitation to assist, for fear of being sued or prosecuted for unintentional injury or "
               "wrongful death. An example of such a law in common-law areas of Canada: a good Samaritan doctrine is a legal "
               "principle that prevents a rescuer who has voluntarily helped a victim in distress from being successfully sued for "
               "wrongdoing. Its purpose is to keep people from being reluctant to help a stranger in need for fear of legal "
               "repercussions should they make some mistake in treatment. By contrast, a duty to rescue law requires people to "
               "offer assistance and holds those who fail to do so liable."),
        _boolq("is the federal court the same as the supreme court", False,
               "Federal judiciary of the United States -- The federal courts are composed of three levels of courts. The Supreme "
               "Court of the United States is the court of last resort. It is generally an appellate court that operates under "
               "discretionary review, which means that the Court can choose which cases to hear, by granting writs of certiorari. "
               "There is therefore generally no basic right of appeal that extends automatically all the way to the Supreme Court. "
               "In a few situations (like lawsuits between state governments or some cases between the federal government and a "
               "state) it sits as a court of original jurisdiction."),
        _boolq("will there be a green lantern 2 movie", False,
               "Green Lantern (film) -- Green Lantern was released on June 17, 2011, and received generally negative reviews; most "
               "criticized the film for its screenplay, inconsistent tone, choice and portrayal of villains, and its use of CGI, "
               "while some praised Reynolds' performance. Reynolds would later voice his dissatisfaction with the film. The film "
               "underperformed at the box office, grossing $219 million against a production budget of $200 million. Due to the "
               "film's negative reception and disappointing box office performance, Warner Bros. canceled any plans for a sequel, "
               "instead opting to reboot the character in the DC Extended Universe line with the film Green Lantern Corps, set for "
               "release in 2020."),
        _boolq("is confectionary sugar the same as powdered sugar", True,
               "Powdered sugar -- Powdered sugar, also called confectioners' sugar, icing sugar, and icing cake, is a finely ground "
               "sugar produced by milling granulated sugar into a powdered state. It usually contains a small amount of anti-caking "
               "agent to prevent clumping and improve flow. Although most often produced in a factory, powdered sugar can also be "
               "made by processing ordinary granulated sugar in a coffee grinder, or by crushing it by hand in a mortar and pestle."),
    ],
    "csqa": [
        _arc("61fe6e879ff18686d7552425a36344c8", "Sammy wanted to go to where the people were.  Where might he go?", "B",
             "race track", "populated areas", "the desert", "apartment", "roadblock"),
        _arc("02e821a3e53cb320790950aab4489e85", "Google Maps and other highway and street GPS services have replaced what?", "D",
             "united states", "mexico", "countryside", "atlas", "oceans"),
        _arc("23505889b94e880c3e89cff4ba119860", "The fox walked from the city into the forest, what was it looking for?", "C",
             "pretty flowers.", "hen house", "natural habitat", "storybook", "dense forest"),
        _arc("a76403b4921a9281b6ee2a7241a5ec9f", "What is it called when you slowly cook using a grill?", "E",
             "backyard", "restaurant", "crockpot", "neighbor's house", "barbeque"),
        _arc("6dc921840aa1e5dda3333b79007f630b", "What would you do if you want to be able to earn money?", "A",
             "apply for job", "stand in line", "take care of proposals", "pass course", "play the lottery"),
    ],
    "hellaswag": [
        _hellaswag(12, "wikihow~19", "Health",
                   "[header] How to cope with suicidal thoughts [title] Put off any plans. [step] Promise yourself that you'll wait "
                   "48 hours before doing anything. Remember, thoughts don't have the power to force you to act.", "", "3",
                   "Even when you do, there may be a small image of the future still lurking around your brain. [substeps] For "
                   "instance, don't tell yourself that you can't make it.",
                   "You're doing something, and no one can force you to act. It's completely natural to feel negative thoughts "
                   "before you act.",
                   "Do not panic if people talk to you (even if it's about quitting smoking). Have a plan for how you're going to "
                   "react to a group of people who bring on suicidal thoughts.",
                   "Sometimes extreme pain can distort our perception. Waiting before taking action will give your mind time to clear."),
        _hellaswag(39, "wikihow~66", "Education and Communications",
                   "[header] How to make a liquid into a solid [title] Place a small open container of water in the freezer "
                   "compartment of a class or home refrigerator. [title] Leave the water there for several hours or overnight. "
                   "[title] Remove from the freezer and note what has occurred.", "", "0",
                   "[step] Water changes state from liquid to solid when it reaches a temperature of 0 degrees celsius, or 32 "
                   "degrees fahrenheit. This is a simple example of changing from liquid to solid, or freezing.",
                   "[substeps] Check that the container is completely dry, but no ice has formed. You should get a sample before "
                   "disposing of it.",
                   "[step] Don't drink and continue making liquid. [title] Separate the ice water if you're not used to using water.",
                   "[title] Set a timer to check on the reaction. [step] The liquid should be safe to use again once the water has "
                   "frozen completely and the food appears firm."),
        _hellaswag(9, "activitynet~v_-2dxp-mv2zo", "Baking cookies",
                   "A female chef in white uniform shows a stack of baking pans in a large kitchen presenting them. The pans are "
                   "filled with pastries and loaded into the oven.", "a knife", "3",
                   "is seen moving on a board and cutting out its contents.",
                   "hits the peeled cheesecake, followed by sliced custard and still cooked ice cream.",
                   "etches a shape into the inside of the baked pans.",
                   "is used to cut cylinder shaped dough into rounds."),
        _hellaswag(47, "activitynet~v_-Xl95IW5H_s", "Starting a campfire",
                   "He takes his lighter and lights the newspaper in several places to start the fire. The bonfire starts burning "
                   "and continues to burn.", "he", "1",
                   "plays with the dog and makes two cookies.",
                   "adds a few more twigs to keep the flames burning.",
                   "gets up and attempts to put a flag on it, fails and makes a complete ass out of himself.",
                   "puts on equipment and stools."),
        _hellaswag(38, "wikihow~62", "Finance and Business",
                   "[header] How to write a method statement [title] Prepare to write by conducting a risk assessment--an in-depth "
                   "examination of the task or process. [substeps] Identify the work hazards (those that could potentially cause "
                   "poor health or personal harm) that are inherent in the task. Analyze what has been done about these hazards and "
                   "if these measures are enough to reduce the harm potential to an acceptable level.", "", "2",
                   "Determine if there are further steps you would like to take. For example, if you want to write about looking as "
                   "though you've truly experienced the problem in practice, doing a risk assessment may help you so further in "
                   "mental illness.",
                   "Review the information presented to the project and get an understanding of the hazards. [title] Organize and "
                   "plan a rest period that will help the sanitation industry and forest service team manage the task more "
                   "effectively.",
                   "Decide what additional measures need to be taken to reduce harm if an acceptable level has not been met. "
                   "[title] Begin to write your method statement, starting at the header.",
                   "[title] Write the search code (cnet) heading. [step] To write an article or report, simply write the following "
                   "code (cnet: alternative sources and outcomes."),
    ],
    "openbookqa": [
        _obqa("7-584", "When standing miles away from Mount Rushmore", "D", "the mountains seem very close",
              "the mountains are boring", "the mountains look the same as from up close",
              "the mountains seem smaller than in photographs"),
        _obqa("7-870", "When food is reduced in the stomach", "C", "the mind needs time to digest",
              "take a second to digest what I said", "nutrients are being deconstructed", "reader's digest is a body of works"),
        _obqa("9-732", "You can make a telescope with a", "D", "straw", "Glass", "Candle", "mailing tube"),
        _obqa("9-782", "Poison causes harm to which of the following?", "A", "a Tree", "a robot", "a house", "a car"),
        _obqa("8-72", "What happens when mercury is placed in water?", "B", "it dissolves", "it sinks", "it floats", "it hardens"),
    ],
    "piqa": [
        _piqa("how do you stab something?", "stick a sharp object through it.", "pin it with a sharp object.", 0),
        _piqa("how do you shake something?", "move it up and down and side to side quickly.", "stir it very quickly.", 0),
        _piqa("Clean tires", "Pour water, cape off caked on dirt. Use  speed wool to clean out crevices and sparrow spaces.",
              "Pour water, scrape off caked on dirt. Use a steel wool to clean out crevices and narrow spaces.", 1),
        _piqa("how do you taste something?", "smell it enough to taste it.", "place it in your mouth to taste.", 1),
        _piqa("To create a makeshift ice pack,",
              "take a sponge and soak it in oil. Put the sponge in a refrigerator and let it freeze. Once frozen, take it out and "
              "put it in a ziploc bag. You can now use it as an ice pack.",
              "take a sponge and soak it in water. Put the sponge in a refrigerator and let it freeze. Once frozen, take it out "
              "and put it in a ziploc bag. You can now use it as an ice pack.", 1),
    ],
    "socialiqa": [
        _siqa("Cameron decided to have a barbecue and gathered her friends together.", "How would Others feel as a result?",
              "like attending", "like staying home", "a good friend to have", "1"),
        _siqa("Quinn wanted to help me clean my room up because it was so messy.", "What will Quinn want to do next?",
              "Eat messy snacks", "help out a friend", "Pick up the dirty clothes", "3"),
        _siqa("Jan needed to give out jobs for an upcoming project at work.", "What will Others want to do next?",
              "disagree with Jan", "get to work", "argue with the assignments", "2"),
        _siqa("Their cat kept trying to escape out of the window, so Jan placed an obstacle in the way.",
              "How would Jan feel afterwards?", "scared of losing the cat", "normal", "relieved for fixing the problem", "3"),
        _siqa("Remy was an expert fisherman and was on the water with Kai. Remy baited Kai's hook.",
              "What will Remy want to do next?", "cast the line", "put the boat in the water", "invite Kai out on the boat", "1"),
    ],
    "winogrande": [
        _winogrande("John moved the couch from the garage to the backyard to create space. The _ is small.", "garage", "backyard", "1"),
        _winogrande("Dennis drew up a business proposal to present to Logan because _ wants his investment.", "Dennis", "Logan", "1"),
        _winogrande("Felicia unexpectedly made fried eggs for breakfast in the morning for Katrina and now _ owes a favor.",
                    "Felicia", "Katrina", "2"),
        _winogrande("The circuit failed to power the television but kept the radio going, as the _ had a weak connection.",
                    "television", "radio", "1"),
        _winogrande("Neil told Craig that he has to take care of the child for the day because _ promised to do so.",
                    "Neil", "Craig", "2"),
    ],
}
