"""A healthy detection loader: images with 0 to 6 boxes each, targets joined YOLO-style. dlwatch must stay silent.

A detection collate stacks the images, (B, 3, H, W), but cannot stack the boxes: their
number changes per image. YOLO-style collates concatenate them into one (N, 6) tensor,
one row per box: [index of its image in the batch, class, x, y, w, h]. N is rarely B
and sometimes a multiple of it; dlwatch must not mistake that for torch.cat where
torch.stack was meant (see examples/cat_collate.py for the real thing).

    python examples/healthy_detection_collate.py [--report-dir DIR]
"""

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports


class Detection(Dataset):
    def __len__(self):
        return 96

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)  # the same boxes for an image in every epoch
        n = int(torch.randint(0, 7, (1,), generator=g))
        image = torch.rand(3, 64, 64, generator=g)
        boxes = torch.rand(n, 4, generator=g)  # x, y, w, h, normalised
        classes = torch.randint(0, 80, (n,), generator=g)
        return image, boxes, classes, f"images/{i:06d}.jpg"


def yolo_collate(samples):
    images = torch.stack([image for image, _, _, _ in samples])  # (B, 3, 64, 64)
    targets = torch.cat(
        [
            torch.cat([torch.full((len(boxes), 1), float(b)), classes[:, None].float(), boxes], dim=1)
            for b, (_, boxes, classes, _) in enumerate(samples)
        ]
    )  # (N, 6), N = boxes in the batch
    paths = [path for _, _, _, path in samples]
    return images, targets, paths


def main():
    args = parse_args(__doc__.splitlines()[0])
    before = incidents(args.report_dir)
    loader = DataLoader(Detection(), batch_size=8, shuffle=True, num_workers=2, collate_fn=yolo_collate)
    rows = []
    with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.2) as batches:
        for epoch in range(2):
            for images, targets, paths in batches:
                assert images.shape[0] == len(paths) and (len(targets) == 0 or int(targets[:, 0].max()) < len(paths))
                rows.append(targets.shape[0])
    print(f"{len(rows)} batches of 8 images; boxes per batch from {min(rows)} to {max(rows)}")
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
