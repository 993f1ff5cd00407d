//! One kernel's measured time against its size (tokens or rows), piecewise
//! linear between the measured points.

/// Microseconds against size. Sizes strictly increase; times never fall,
/// so a prediction never falls as a launch grows and extrapolation past the
/// last point never turns negative.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    sizes: Vec<f64>,
    micros: Vec<f64>,
}

/// The longest time a table may hold: one hour, in microseconds.
pub const MAX_MICROS: f64 = 3.6e9;

impl Table {
    /// `[size, microseconds]` points; the message says which point is wrong.
    pub fn new(points: &[[f64; 2]]) -> Result<Table, String> {
        if points.len() < 2 {
            return Err(format!("needs at least 2 points, got {}", points.len()));
        }
        for (i, &[size, us]) in points.iter().enumerate() {
            if !(size.is_finite() && size > 0.0) {
                return Err(format!("point {i}: size must be a positive number, got {size}"));
            }
            // An hour per kernel call is no measurement: a larger time is a unit or typing mistake,
            // and would make route sums overflow to infinity.
            if !(us.is_finite() && (0.0..=MAX_MICROS).contains(&us)) {
                return Err(format!("point {i}: time must be between 0 and {MAX_MICROS:e} microseconds, got {us}"));
            }
            if i > 0 {
                let [prev_size, prev_us] = points[i - 1];
                if size <= prev_size {
                    return Err(format!("point {i}: sizes must strictly increase, got {size} after {prev_size}"));
                }
                if us < prev_us {
                    return Err(format!(
                        "point {i}: times must not fall as sizes grow, got {us} us at {size} after {prev_us} us at {prev_size}"
                    ));
                }
            }
        }
        Ok(Table { sizes: points.iter().map(|p| p[0]).collect(), micros: points.iter().map(|p| p[1]).collect() })
    }

    /// Predicted microseconds at `size`: 0 for no work; the first point's
    /// time below it (small launches are latency-bound, so the first measured
    /// time is their floor); linear between points; past the last point, the
    /// line through the last two.
    pub fn micros(&self, size: u64) -> f64 {
        if size == 0 {
            return 0.0;
        }
        let x = size as f64;
        if x <= self.sizes[0] {
            return self.micros[0];
        }
        // The segment [i, i + 1] that holds x, or the last one past the end.
        let i = self.sizes.partition_point(|&s| s < x).clamp(1, self.sizes.len() - 1) - 1;
        let (x0, x1, y0, y1) = (self.sizes[i], self.sizes[i + 1], self.micros[i], self.micros[i + 1]);
        y0 + (x - x0) * (y1 - y0) / (x1 - x0)
    }

    /// The points as given.
    pub fn points(&self) -> impl Iterator<Item = (f64, f64)> + '_ {
        self.sizes.iter().copied().zip(self.micros.iter().copied())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn table() -> Table {
        Table::new(&[[64.0, 20.0], [128.0, 30.0], [1024.0, 100.0], [4096.0, 400.0]]).unwrap()
    }

    #[test]
    fn exact_at_grid_points() {
        let t = table();
        for (size, us) in t.points() {
            assert_eq!(t.micros(size as u64), us);
        }
    }

    #[test]
    fn linear_between_below_and_beyond() {
        let t = table();
        assert_eq!(t.micros(96), 25.0);
        assert_eq!(t.micros(576), 65.0);
        assert_eq!(t.micros(0), 0.0);
        assert_eq!(t.micros(1), 20.0, "below the grid: the first point's time");
        // Past the last point: the line through (1024, 100) and (4096, 400).
        assert_eq!(t.micros(7168), 700.0);
    }

    #[test]
    fn refuses_bad_tables() {
        let bad: [&[[f64; 2]]; 6] = [
            &[[64.0, 1.0]],
            &[[64.0, 1.0], [64.0, 2.0]],
            &[[128.0, 1.0], [64.0, 2.0]],
            &[[64.0, 2.0], [128.0, 1.0]],
            &[[0.0, 1.0], [64.0, 2.0]],
            &[[64.0, f64::NAN], [128.0, 2.0]],
        ];
        for points in bad {
            assert!(Table::new(points).is_err(), "{points:?}");
        }
        let msg = Table::new(&[[64.0, 2.0], [128.0, 1.0]]).unwrap_err();
        assert!(msg.contains("point 1") && msg.contains("must not fall"), "{msg}");
    }

    proptest! {
        /// Any valid table predicts a time that never falls as the size grows.
        #[test]
        fn monotone(steps in prop::collection::vec((1u32..5_000, 0.0f64..1_000.0), 2..12), a in 0u64..100_000, b in 0u64..100_000) {
            let mut points = Vec::new();
            let (mut size, mut us) = (0.0, 0.0);
            for (ds, du) in steps {
                size += f64::from(ds);
                us += du;
                points.push([size, us]);
            }
            let t = Table::new(&points).unwrap();
            let (lo, hi) = (a.min(b), a.max(b));
            prop_assert!(t.micros(lo) <= t.micros(hi) + 1e-9 * t.micros(hi).abs(), "{} > {}", t.micros(lo), t.micros(hi));
        }
    }
}
