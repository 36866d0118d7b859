"""Deterministic sample data for the zoo's example inputs: images and waveforms drawn from a seed.

Real preprocessing needs real-looking data (the image processor resizes by content size, the audio
front end pads and masks by length), and no dataset can be downloaded, so these stand in for it.
``example_inputs`` and the pipelines' demos use them; tests draw them with their own seeds.
"""

from __future__ import annotations

import numpy as np
import PIL.Image
import PIL.ImageDraw


def synthetic_image(height: int, width: int, seed: int = 0) -> PIL.Image.Image:
    """A deterministic RGB test image: colour gradients, a few shapes and pixel noise.

    Args:
        height: image height in pixels.
        width: image width in pixels.
        seed: selects the shapes, colours and noise.

    Returns:
        An RGB ``PIL.Image.Image`` of size ``(width, height)``.

    Example::

        img = synthetic_image(448, 448, seed=3)
    """
    rng = np.random.default_rng(seed)
    ys = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None]
    xs = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :]
    phase = rng.uniform(0.0, 2.0 * np.pi, size=3)
    radial = np.sqrt((xs - 0.5) ** 2 + (ys - 0.5) ** 2)
    base = np.stack(
        [
            0.5 + 0.5 * np.sin(2.0 * np.pi * xs + phase[0]) * np.ones_like(ys),
            0.5 + 0.5 * np.cos(2.0 * np.pi * ys + phase[1]) * np.ones_like(xs),
            0.5 + 0.5 * np.cos(6.0 * np.pi * radial + phase[2]),
        ],
        axis=-1,
    )
    image = PIL.Image.fromarray((base * 255.0).astype(np.uint8))
    draw = PIL.ImageDraw.Draw(image)
    for _ in range(6):
        x0, x1 = sorted(rng.uniform(0, width, size=2).tolist())
        y0, y1 = sorted(rng.uniform(0, height, size=2).tolist())
        color = tuple(int(c) for c in rng.integers(0, 256, size=3))
        if rng.random() < 0.5:
            draw.rectangle([x0, y0, x1, y1], fill=color)
        else:
            draw.ellipse([x0, y0, x1, y1], fill=color)
    for _ in range(4):
        points = [(float(rng.uniform(0, width)), float(rng.uniform(0, height))) for _ in range(2)]
        color = tuple(int(c) for c in rng.integers(0, 256, size=3))
        draw.line(points, fill=color, width=max(1, min(height, width) // 64))
    pixels = np.asarray(image, dtype=np.float32)
    pixels = pixels + rng.normal(0.0, 8.0, size=pixels.shape)
    return PIL.Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def synthetic_waveform(seconds: float, sampling_rate: int = 16000, seed: int = 0) -> np.ndarray:
    """A deterministic mono test signal: a few linear chirps under an envelope, plus noise.

    Args:
        seconds: duration.
        sampling_rate: samples per second.
        seed: selects the chirps and the noise.

    Returns:
        ``float32`` array of ``round(seconds * sampling_rate)`` samples, peak amplitude 0.5.

    Example::

        wav = synthetic_waveform(30.0)  # 480000 samples
    """
    rng = np.random.default_rng(seed)
    n = int(round(seconds * sampling_rate))
    t = np.arange(n, dtype=np.float64) / sampling_rate
    duration = max(seconds, 1.0 / sampling_rate)
    nyquist = sampling_rate / 2.0
    signal = np.zeros(n, dtype=np.float64)
    for _ in range(3):
        f0, f1 = rng.uniform(80.0, 0.8 * nyquist, size=2)
        amp = rng.uniform(0.3, 1.0)
        rate = rng.uniform(0.2, 3.0)
        # Linear chirp: instantaneous frequency f0 + (f1 - f0) * t / duration.
        chirp = np.sin(2.0 * np.pi * (f0 * t + 0.5 * (f1 - f0) * t**2 / duration))
        envelope = 0.5 + 0.5 * np.sin(2.0 * np.pi * rate * t + rng.uniform(0, 2 * np.pi))
        signal += amp * envelope * chirp
    signal += 0.05 * rng.standard_normal(n)
    peak = np.max(np.abs(signal)) if n else 1.0
    return (0.5 * signal / max(peak, 1e-8)).astype(np.float32)
