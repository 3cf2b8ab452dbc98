"""Two texture classifiers, ``reward`` (scores GRPO rollouts: reward = p(target class)) and a held-out
``eval`` (judges sample quality), with the digits' architectures and recipe at 6 classes on the
textures train split (``jaggc_studies.classifier_kit``).

``python -m jaggc_studies.textures.classifier`` trains both and writes ``weights/classifier_{reward,eval}.pt`` (fp16).
"""

from __future__ import annotations

from jaggc_studies.classifier_kit import ClassifierKit

from jaggc_studies.textures.data import NUM_CLASSES, load_textures_split
from jaggc_studies.textures.model import WEIGHTS_DIR

KIT = ClassifierKit(weights_dir=WEIGHTS_DIR, num_classes=NUM_CLASSES, load_split=load_textures_split,
                    regen_command="python -m jaggc_studies.textures.classifier", default_epochs=12)
classifier_reward = KIT.classifier_reward
load_classifier = KIT.load_classifier


def main(argv: list[str] | None = None) -> None:
    KIT.main(argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
