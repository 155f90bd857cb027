"""torch.cat where torch.stack was meant: a batch of 4 images becomes 4*3 rows next to 4 labels.

Nothing raises: the loop runs to the end, and a model would silently train on
the wrong rows (or fail much later with a shape error in the loss). dlwatch's
shape probe sees the first wrong batch and writes a `threshold` incident with
playbook batch-dim-mismatch.

    python examples/cat_collate.py [--report-dir DIR]
"""

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports


class Images(Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.full((3, 8, 8), float(i)), i  # a 3-channel 8x8 "image" and its label


def cat_collate(samples):
    images = torch.cat([image for image, _ in samples])  # BUG: (4*3, 8, 8); torch.stack gives (4, 3, 8, 8)
    labels = torch.tensor([label for _, label in samples])  # (4,)
    return images, labels


def main():
    args = parse_args(__doc__.splitlines()[0])
    before = incidents(args.report_dir)
    loader = DataLoader(Images(), batch_size=4, num_workers=2, collate_fn=cat_collate)
    with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.2) as batches:
        for images, labels in batches:
            pass  # images.shape == (12, 8, 8), labels.shape == (4,): no error here
    print(f"loop finished: last batch images {tuple(images.shape)}, labels {tuple(labels.shape)}")
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
