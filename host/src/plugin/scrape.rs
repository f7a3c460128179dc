//! The plugins' own figures (reloads, refused files, registry states), read
//! from their slots each time `/metrics` is scraped.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use super::{PluginSlot, Plugins};
use crate::metrics::{PluginLabel, REGISTRY_GAUGES, RELOAD_COUNTERS, SourceLabels};

impl Plugins {
    /// What `/metrics` reads from these plugins at scrape time.
    pub fn scraped(&self) -> Box<dyn Collector> {
        Box::new(ReloadCollector {
            plugins: self.clone(),
        })
    }
}

/// Reads the plugin slots' reload counters at scrape time.
pub(crate) struct ReloadCollector {
    plugins: Plugins,
}

impl std::fmt::Debug for ReloadCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReloadCollector")
    }
}

impl Collector for ReloadCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let reads = [
            PluginSlot::reloads as fn(&PluginSlot) -> u64,
            PluginSlot::rejected,
        ];
        for ((name, help), read) in RELOAD_COUNTERS.into_iter().zip(reads) {
            let mut family = encoder.encode_descriptor(
                name,
                help,
                None,
                prometheus_client::metrics::MetricType::Counter,
            )?;
            for slot in self.plugins.slots() {
                let counter = ConstCounter::new(read(slot));
                let labels = PluginLabel {
                    plugin: slot.config().name.clone(),
                };
                counter.encode(family.encode_family(&labels)?)?;
            }
        }
        let registry: Vec<_> = self
            .plugins
            .slots()
            .iter()
            .filter_map(|slot| slot.oci().map(|state| (slot.config().name.clone(), state)))
            .collect();
        if registry.is_empty() {
            return Ok(());
        }
        let gauge = prometheus_client::metrics::MetricType::Gauge;
        let (name, help) = REGISTRY_GAUGES[0];
        let mut family = encoder.encode_descriptor(name, help, None, gauge)?;
        for (plugin, state) in &registry {
            let labels = SourceLabels {
                plugin: plugin.clone(),
                reference: state.reference.clone(),
                digest: state.digest.clone().unwrap_or_default(),
            };
            ConstGauge::new(1_i64).encode(family.encode_family(&labels)?)?;
        }
        let (name, help) = REGISTRY_GAUGES[1];
        let mut family = encoder.encode_descriptor(name, help, None, gauge)?;
        for (plugin, state) in &registry {
            let labels = PluginLabel {
                plugin: plugin.clone(),
            };
            ConstGauge::new(i64::from(state.registry_error.is_none()))
                .encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}
