"""Several augmented views of each training sample (data.views), as contrastive tasks (SimCLR) train
on: a training sample becomes `((view_1, ..., view_n), label)`, each view its own draw of the
augmentation. Validation stays one eval-transformed image and its label.

The draws come from torch's global RNG, as every augmentation here does, seeded per sample by (seed,
epoch, index) as the loader loads it (ddp/loading/sample_seeds.py); the views are drawn one after the
other. So a sample's views are the same at any world size and worker count, and resume exactly.
data.views=1 leaves every dataset exactly as it was.

SimCLR's augmentation (Chen et al. 2020, appendix A) is a random resized crop, a horizontal flip,
colour jitter (p 0.8), grayscale (p 0.2) and a Gaussian blur (p 0.5, kernel about a tenth of the
image side, sigma in [0.1, 2]). The colour steps need RGB values in [0, 1], so only images read from
files (data/presets.py) get them; synthetic (Gaussian values, any channels) gets the crop, the flip
and the blur, digits (standardised 1-channel 8x8 strokes) a milder crop alone (`tensor_view_transform`)."""

from torch.utils.data import Dataset

from ddp.config.schema import ConfigError

BLUR_SIGMA = (0.1, 2.0)
# At 8 to 16 pixels, SimCLR's smallest crop (8% of the area) keeps a 2x2 patch of a digit: nothing
# left to recognise. The tensor datasets crop at least a quarter of the image.
TENSOR_CROP_SCALE = (0.25, 1.0)
STROKES_CROP_SCALE = (0.5, 1.0)


def check_views(views: int) -> int:
    if views < 1:
        raise ConfigError(f"data.views={views}: must be >= 1 (1: one image per training sample; "
                          "2: two augmented views, as task=simclr trains on)")
    return views


class Views:
    """`count` independent draws of `transform` on one image, as a tuple: a training sample's views."""

    def __init__(self, transform, count: int):
        self.transform, self.count = transform, count

    def __call__(self, image):
        return tuple(self.transform(image) for _ in range(self.count))

    def __repr__(self) -> str:
        return f"Views(count={self.count}, transform={self.transform!r})"


class TransformedImages(Dataset):
    """(transform(image), label) for each (image, label) of `base`: the views of a tensor dataset."""

    def __init__(self, base: Dataset, transform):
        self.base, self.transform = base, transform

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index):
        image, label = self.base[index]
        return self.transform(image), label


def blur_kernel_size(image_size: int) -> int:
    """SimCLR's blur kernel, a tenth of the image side, made odd; at least 3."""
    return max(3, int(0.1 * image_size) // 2 * 2 + 1)


def tensor_view_transform(image_size: int, augment: bool, strokes: bool = False):
    """A view of a tensor image (C x H x W, any values): crop, flip and blur when augmenting; the
    image itself (its eval transform) when not. `strokes`: images of a few strokes (8 px digits), which
    a mirror makes other shapes (a mirrored 2 is no 2) and a blur erases: crops of at least half the
    image only (on digits the online probe reached 0.82 that way, against 0.46 with flip and blur)."""
    from torchvision.transforms import v2  # here: importing torchvision costs every run a second

    if not augment:
        return v2.Identity()
    if strokes:
        return v2.RandomResizedCrop(image_size, scale=STROKES_CROP_SCALE, antialias=True)
    return v2.Compose([
        v2.RandomResizedCrop(image_size, scale=TENSOR_CROP_SCALE, antialias=True),
        v2.RandomHorizontalFlip(),
        v2.RandomApply([v2.GaussianBlur(blur_kernel_size(image_size), BLUR_SIGMA)], p=0.5),
    ])


def tensor_views(train: Dataset, image_size: int, augment: bool, views: int, strokes: bool = False) -> Dataset:
    """The training split of a tensor dataset with `views` views of each sample."""
    return TransformedImages(train, Views(tensor_view_transform(image_size, augment, strokes), views))
