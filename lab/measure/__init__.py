"""Counting and measuring: parameters, FLOPs and bytes on paper (``accounting``), the allocation meter
(``memory``), devices, precision and their peaks (``device``), and the laws of loss the fits and the runs'
expectations evaluate (``laws``)."""
