"""Two shape classifiers, ``reward`` (scores GRPO rollouts: reward = p(target class)) and a held-out
``eval`` (judges sample quality), with the digits' architectures and recipe at 6 classes on the
shapes train split (``jaggc_studies.classifier_kit``).

``python -m jaggc_studies.shapes.classifier`` trains both and writes ``weights/classifier_{reward,eval}.pt`` (fp16).
"""

from __future__ import annotations

from jaggc_studies.classifier_kit import ClassifierKit

from jaggc_studies.shapes.data import NUM_CLASSES, load_shapes_split
from jaggc_studies.shapes.model import WEIGHTS_DIR

CLASSIFIER_REGEN_COMMAND = "python -m jaggc_studies.shapes.classifier"
DEFAULT_EPOCHS = 12
KIT = ClassifierKit(weights_dir=WEIGHTS_DIR, num_classes=NUM_CLASSES, load_split=load_shapes_split,
                    regen_command=CLASSIFIER_REGEN_COMMAND, default_epochs=DEFAULT_EPOCHS)

classifier_path = KIT.classifier_path
train_shapes_classifier = KIT.train
accuracy = KIT.accuracy
load_classifier = KIT.load_classifier
classifier_reward = KIT.classifier_reward


def main(argv: list[str] | None = None) -> None:
    KIT.main(argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
