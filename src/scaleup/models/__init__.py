from scaleup.models.classifier import ImageClassifier
from scaleup.models.nets import DigitsCNN, resnet

__all__ = ["DigitsCNN", "ImageClassifier", "resnet"]
