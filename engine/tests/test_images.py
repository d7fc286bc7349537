"""The image pipeline: decoded by torchvision.io into uint8, transformed on uint8, batches that travel as uint8 and
are normalised on the device to what ToTensor + Normalize gave, augmentation seeded per sample, decode errors that
name the file, and (GPU lane) nvjpeg decoding that equals the CPU's."""

from functools import partial

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import transforms as T
from torchvision.io import read_file

from scaleup.callbacks.step_plan import StepPlan
from scaleup.data.image_batches import normalize
from scaleup.data.images import EncodedBatch, ImageFiles, ImageTransform, decode
from scaleup.data.seeding import SeededSamples
from scaleup.errors import UserError, as_user_error
from scaleup.plan.batch_probe import repeated
from testbed.data import IMAGENET_MEAN, IMAGENET_STD, ImageTreeDataModule

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (nvjpeg), none visible")


@pytest.fixture(scope="module")
def jpeg_tree(tmp_path_factory):
    """root/{train,val}/{a,b}/*.jpg: 4 + 2 60x45 JPEGs per class (smooth colour fields with fine noise, as
    photographs go), the same bytes every run."""
    root, rng = tmp_path_factory.mktemp("jpegs"), np.random.default_rng(0)
    for split, count in (("train", 4), ("val", 2)):
        for label in ("a", "b"):
            (root / split / label).mkdir(parents=True)
            for i in range(count):
                coarse = Image.fromarray(rng.integers(0, 256, (3, 4, 3), dtype=np.uint8)).resize((60, 45), 3)
                pixels = np.asarray(coarse, dtype=np.int16) + rng.normal(0, 12, (45, 60, 3)).astype(np.int16)
                Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(root / split / label / f"{i}.jpg")
    return root


def data(root, **kwargs) -> ImageTreeDataModule:
    return ImageTreeDataModule(**{"num_workers": 0, **kwargs}, root=str(root), image_size=32, global_batch_size=4)


def test_normalised_on_the_device_equals_totensor_and_normalize():
    images = torch.randint(0, 256, (5, 3, 7, 9), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    before = T.Compose([T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    expected = torch.stack([before(image.permute(1, 2, 0).numpy()) for image in images])
    assert torch.equal(normalize(images, IMAGENET_MEAN, IMAGENET_STD), expected)
    nhwc = normalize(images, IMAGENET_MEAN, IMAGENET_STD, channels_last=True)
    assert nhwc.is_contiguous(memory_format=torch.channels_last) and torch.equal(nhwc, expected)


def test_image_batches_travel_as_uint8_and_reach_the_model_as_the_precision_wants(jpeg_tree):
    dm = data(jpeg_tree)
    images, labels = next(iter(dm.train_dataloader()))
    assert images.dtype == torch.uint8 and images.shape == (4, 3, 32, 32)
    expected = normalize(images, IMAGENET_MEAN, IMAGENET_STD)
    assert torch.equal(dm.on_after_batch_transfer((images, labels), 0)[0], expected)  # outside a Trainer
    dm.trainer = L.Trainer(accelerator="cpu", precision="64-true", logger=False, enable_progress_bar=False)
    x, y = dm.on_after_batch_transfer((images, labels), 0)
    assert x.dtype == torch.float64 and torch.equal(x, expected.double()) and y is labels


class LayoutProbe(L.LightningModule):
    """A convolution, and the memory layout of every validation batch it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.layouts = torch.nn.Conv2d(3, 4, 3), []

    def validation_step(self, batch, batch_idx) -> None:
        self.layouts.append(batch[0].is_contiguous(memory_format=torch.channels_last))


def test_channels_last_lays_out_the_weights_and_the_batches_alike(jpeg_tree):
    """performance.channels_last=true: StepPlan converts the weights and tells the data module, in every
    process, so that the normalised batches reach the first convolution in the weights' layout."""
    probe, settings = LayoutProbe(), StepPlan(tf32=False, channels_last=True)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, callbacks=[settings])
    trainer.validate(probe, datamodule=data(jpeg_tree), verbose=False)
    assert probe.layouts == [True] and probe.conv.weight.is_contiguous(memory_format=torch.channels_last)


def test_the_auto_batch_probe_feeds_the_model_normalised_images(jpeg_tree):
    """data.max_per_device_batch_size=auto probes with one training sample repeated: through the same hooks."""
    dm = data(jpeg_tree)
    dm.setup()
    image, label = dm.splits["train"][0]
    x, y = repeated((image, label), 3, torch.device("cpu"), lambda batch: batch, dm)
    assert x.shape == (3, 3, 32, 32) and torch.equal(
        x, normalize(image[None], IMAGENET_MEAN, IMAGENET_STD).expand(3, -1, -1, -1)
    )
    assert y.tolist() == [label] * 3


def test_evaluation_images_are_the_pil_pipelines_to_one_grey_level(jpeg_tree):
    """The same decoder (libjpeg-turbo) and antialiased bilinear resizing as PIL's: the evaluation transform of
    before (PIL Resize + CenterCrop) and of now differ by at most 1 of 255 per pixel."""
    path = next((jpeg_tree / "val" / "a").iterdir())
    before = T.Compose([T.Resize(37), T.CenterCrop(32), T.PILToTensor()])(Image.open(path).convert("RGB"))
    now = ImageTransform(32, train=False).from_bytes(read_file(str(path)), str(path))
    assert now.dtype == torch.uint8 and (now.int() - before.int()).abs().max() <= 1
    assert torch.equal(ImageTransform(32, train=False).from_bytes(path.read_bytes(), str(path)), now)  # a record


def test_augmentation_depends_on_seed_epoch_and_index_in_any_worker(jpeg_tree):
    """transforms.v2's functional ops with torchvision's crop sampling draw from torch's global generator, which
    SeededSamples seeds per sample: the same crop and flip for (seed, epoch, index), in the main process or in a
    loader worker; and drawing the parameters from the header alone (the GPU path) draws the same ones."""
    dm = data(jpeg_tree)
    dm.setup()
    samples = SeededSamples(dm.splits["train"], seed=42)
    image = samples[(1, 5)][0]
    torch.rand(10)
    assert torch.equal(samples[(1, 5)][0], image)
    assert not torch.equal(samples[(2, 5)][0], image) and not torch.equal(samples[(1, 6)][0], image)
    in_main = next(iter(dm.train_dataloader()))[0]
    dm.num_workers = 1
    assert torch.equal(next(iter(dm.train_dataloader()))[0], in_main)

    path = dm.splits["train"].samples[5][0]
    encoded, transform = read_file(path), dm.splits["train"].transform
    torch.default_generator.manual_seed(7)
    _, params = EncodedBatch.sample(transform, encoded, path)
    torch.default_generator.manual_seed(7)
    assert torch.equal(transform.apply(decode(encoded, path), params), transform.from_bytes(encoded, path))


def first_batch_error(dm: ImageTreeDataModule) -> str:
    """The user error the first training batch raises. Its traceback is dropped at once: torch's re-raise leaves it
    in a reference cycle, which would hand the loader's worker to the garbage collector, which finalises the
    worker's queues first and then waits 5 s for it to stop."""
    loader = iter(dm.train_dataloader())
    try:
        next(loader)
    except UserError as err:
        err.__traceback__ = None
        return str(as_user_error(err))
    raise AssertionError("the first batch loaded")


def test_a_corrupt_image_is_one_message_naming_the_file(jpeg_tree, tmp_path):
    """Before, PIL's traceback: `cannot identify image file <_io.BufferedReader name=...>` for garbage, and
    `image file is truncated` without the file's name for a cut file. Now one line that names it, also when a
    loader worker hit it."""
    good = next((jpeg_tree / "train" / "a").iterdir()).read_bytes()
    for name, content in (("garbage.jpg", b"not an image at all"), ("cut.jpg", good[: len(good) // 2])):
        root = tmp_path / name
        (root / "train" / "a").mkdir(parents=True)
        for i in range(3):  # the first batch of 4 holds the broken file
            (root / "train" / "a" / f"{i}.jpg").write_bytes(good)
        (root / "train" / "a" / name).write_bytes(content)
        message = first_batch_error(data(root, num_workers=1))
        assert message.startswith(f"{root / 'train' / 'a' / name}: not a readable image (")
        assert message.endswith("); remove or replace the file") and "\n" not in message


def test_formats_torchvision_does_not_decode_are_read_through_pil(tmp_path):
    """ImageFolder also lists .bmp, .tif and .ppm files, which PIL read before: still read, the same pixels."""
    pixels = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    for suffix in ("bmp", "tiff", "ppm"):
        path = tmp_path / f"x.{suffix}"
        Image.fromarray(pixels).save(path)
        assert torch.equal(decode(path.read_bytes(), str(path)), torch.from_numpy(pixels).permute(2, 0, 1))
    with pytest.raises(
        UserError, match=r"x.txt: not a readable image \(no image format PIL or torchvision knows\); remove"
    ):
        decode(b"plain text", str(tmp_path / "x.txt"))


def test_the_gpu_paths_worker_half_runs_on_any_machine(jpeg_tree, tmp_path):
    """data.decode_device=cuda's loader: workers send the bytes as read and the drawn parameters, collated into
    an EncodedBatch, which only a CUDA device decodes; a PNG is refused naming the file (nvjpeg decodes JPEGs)."""
    dm = data(jpeg_tree)
    dm.setup()
    cpu_files = dm.splits["train"]
    files = ImageFiles(cpu_files.samples, cpu_files.transform, encoded=True)
    loader = DataLoader(
        SeededSamples(files, 0), batch_size=4, collate_fn=partial(EncodedBatch.collate, files.transform)
    )
    batch = next(iter(loader))
    assert isinstance(batch, EncodedBatch) and batch.labels.tolist() == [0, 0, 0, 0]
    assert [len(d) for d in batch.data] == [len(read_file(path)) for path, _ in files.samples[:4]]
    assert all(len(params) == 5 for params in batch.params)  # top, left, height, width, flip
    with pytest.raises(UserError, match=r"^data.decode_device=cuda decodes on a CUDA GPU, and this run trains on cpu"):
        batch.decode(torch.device("cpu"))
    png = tmp_path / "x.png"
    Image.new("RGB", (8, 8)).save(png)
    with pytest.raises(UserError, match=rf"^{png}: a PNG image, and data.decode_device=cuda decodes JPEGs only"):
        EncodedBatch.sample(files.transform, read_file(str(png)), str(png))


@pytest.mark.gpu
@needs_gpu
def test_nvjpeg_batches_equal_the_cpu_pipeline(jpeg_tree):
    """The same samples decoded by nvjpeg on the GPU and by libjpeg-turbo on the CPU, with the same drawn crops and
    flips: equal to a few grey levels (the two decoders round their IDCT and upsampling differently)."""
    batches = {}
    for device in ("cpu", "cuda"):
        dm = data(jpeg_tree, decode_device=device)
        dm.trainer = L.Trainer(accelerator="gpu", devices=1, logger=False, enable_progress_bar=False)
        batch = dm.on_before_batch_transfer(next(iter(dm.train_dataloader())), 0)
        batches[device] = batch[0].cpu()
        assert batch[0].dtype == torch.uint8 and batch[0].shape == (4, 3, 32, 32)
    difference = (batches["cuda"].int() - batches["cpu"].int()).abs().float()
    assert difference.mean() < 1.5 and difference.max() <= 24
