"""The zoo's model names, readable without torch: the service states them in its OpenAPI
document (a spec's ``model``), and the client commands must not import torch.
:mod:`models.zoo` builds exactly these (``zoo.MODELS`` is this tuple; its import checks it
has a builder for each)."""

MODELS: tuple[str, ...] = ("alexnet", "vgg16", "inception_v3", "resnet50", "gpt", "digits_cnn")
