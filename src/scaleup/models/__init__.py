from scaleup.models.classifier import ImageClassifier
from scaleup.models.language_model import CharLanguageModel
from scaleup.models.nets import DigitsCNN, resnet
from scaleup.models.transformer import CharTransformer

__all__ = ["CharLanguageModel", "CharTransformer", "DigitsCNN", "ImageClassifier", "resnet"]
