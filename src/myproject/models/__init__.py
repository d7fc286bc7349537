from myproject.models.classifier import ImageClassifier
from myproject.models.language_model import CharLanguageModel
from myproject.models.nets import DigitsCNN, resnet
from myproject.models.transformer import CharTransformer

__all__ = ["CharLanguageModel", "CharTransformer", "DigitsCNN", "ImageClassifier", "resnet"]
