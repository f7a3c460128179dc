//! The overview's small charts: every database's published events and
//! commit-to-publish times sampled every few seconds from memory (no
//! database query), kept for the last minutes, and drawn as inline SVG.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use maud::{Markup, html};

use crate::metrics::RecentSample;

/// How often every database is sampled.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(2);

/// Samples kept per database: five minutes.
const KEPT: usize = 150;

/// One point of a database's charts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    /// Seconds before now.
    pub ago: f64,
    /// Events published per second over the interval.
    pub rate: f64,
    /// Commit-to-publish median over the interval, seconds.
    pub p50: Option<f64>,
    /// Commit-to-publish 99th percentile over the interval, seconds.
    pub p99: Option<f64>,
}

/// A database's samples, oldest first.
type Samples = VecDeque<(Instant, RecentSample)>;

/// Every database's recent samples.
#[derive(Default, Clone)]
pub struct Charts {
    samples: Arc<Mutex<HashMap<String, Samples>>>,
}

impl Charts {
    /// Records one sample per database in `now`; forgets the databases
    /// not in it.
    pub fn record(&self, now: Vec<(String, RecentSample)>) {
        let at = Instant::now();
        let mut samples = self
            .samples
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        samples.retain(|name, _| now.iter().any(|(present, _)| present == name));
        for (name, sample) in now {
            let kept = samples.entry(name).or_default();
            if kept.len() == KEPT {
                kept.pop_front();
            }
            kept.push_back((at, sample));
        }
    }

    /// A database's points, oldest first.
    pub fn points(&self, database: &str) -> Vec<Point> {
        let samples = self
            .samples
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(kept) = samples.get(database) else {
            return Vec::new();
        };
        kept.iter()
            .zip(kept.iter().skip(1))
            .map(|((then, before), (at, after))| {
                let seconds = at.duration_since(*then).as_secs_f64().max(0.001);
                Point {
                    ago: at.elapsed().as_secs_f64(),
                    rate: after.published.saturating_sub(before.published) as f64 / seconds,
                    p50: after.quantile_since(before, 0.5),
                    p99: after.quantile_since(before, 0.99),
                }
            })
            .collect()
    }
}

/// A line chart of `values` (oldest first; `None` leaves a gap), with its
/// title and latest value.
pub fn sparkline(title: &str, values: &[Option<f64>], unit: Unit) -> Markup {
    const WIDTH: f64 = 300.0;
    const HEIGHT: f64 = 48.0;
    let top = values.iter().flatten().copied().fold(0.0_f64, f64::max);
    let scale = if top > 0.0 { top } else { 1.0 };
    // The last minute at least, five at most: a fresh relay's first
    // samples make a line, not a dot at the right edge.
    let window = values.len().clamp(30, KEPT);
    let step = WIDTH / (window as f64 - 1.0);
    let first = window.saturating_sub(values.len());
    let mut lines: Vec<String> = Vec::new();
    let mut current = String::new();
    for (i, value) in values.iter().enumerate() {
        match value {
            Some(value) => {
                let x = (first + i) as f64 * step;
                let y = HEIGHT - (value / scale) * (HEIGHT - 2.0) - 1.0;
                current.push_str(&format!("{x:.1},{y:.1} "));
            }
            None if !current.is_empty() => lines.push(std::mem::take(&mut current)),
            None => {}
        }
    }
    if !current.is_empty() {
        lines.push(current);
    }
    let latest = values.iter().rev().flatten().next().copied();
    // The newest point, marked: a chart of one sample still shows it.
    let dot = values.last().copied().flatten().map(|value| {
        let x = (first + values.len() - 1) as f64 * step;
        (x, HEIGHT - (value / scale) * (HEIGHT - 2.0) - 1.0)
    });
    html! {
        figure.chart {
            figcaption {
                (title) ": "
                strong { (latest.map_or_else(|| "no events".to_string(), |v| unit.show(v))) }
                " (top " (unit.show(top)) ")"
            }
            svg viewBox={"0 0 " (WIDTH) " " (HEIGHT)} width=(WIDTH) height=(HEIGHT) role="img" aria-label=(title) {
                @for points in &lines {
                    polyline points=(points) {}
                }
                @if let Some((x, y)) = dot {
                    circle cx=(format!("{x:.1}")) cy=(format!("{y:.1}")) r="2.5" {}
                }
            }
        }
    }
}

/// How a chart shows its values.
#[derive(Debug, Clone, Copy)]
pub enum Unit {
    /// Events per second.
    PerSecond,
    /// A time in seconds.
    Seconds,
}

impl Unit {
    fn show(self, value: f64) -> String {
        match self {
            Unit::PerSecond => format!("{value:.0}/s"),
            Unit::Seconds => super::pages::duration(value),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_are_rates_and_quantiles_between_samples() {
        let charts = Charts::default();
        let recent = crate::metrics::Recent::default();
        charts.record(vec![("a".into(), recent.sample())]);
        recent.published(50);
        for _ in 0..50 {
            recent.observe(0.01);
        }
        std::thread::sleep(Duration::from_millis(100));
        charts.record(vec![("a".into(), recent.sample())]);
        let points = charts.points("a");
        assert_eq!(points.len(), 1);
        assert!(
            points[0].rate > 100.0 && points[0].rate <= 500.0,
            "{:?}",
            points[0]
        );
        assert!(
            points[0].p50.is_some_and(|p| p > 0.008 && p <= 0.016),
            "{:?}",
            points[0]
        );
        charts.record(vec![]);
        assert!(charts.points("a").is_empty(), "a database that left is forgotten");
    }

    #[test]
    fn a_chart_draws_gaps_and_says_its_latest_value() {
        let markup = sparkline("p99", &[Some(0.5), None, Some(1.0), Some(0.25)], Unit::Seconds).into_string();
        assert_eq!(markup.matches("<polyline").count(), 2, "{markup}");
        assert!(markup.contains("250 ms"), "{markup}");
    }
}
