//! The coordinator core's registration of regions and proxies: which it refuses (another
//! shard-id extractor, or settings that must agree with other values) and what an accepted
//! one is sent (every known home, in bounded batches, before its ack).

use super::*;

impl CoordinatorCore {
    /// Why a registration is refused, if it is: another shard-id extractor (the same entity id
    /// would map to two shards), or, for a region that hosts, a setting that must agree with
    /// another value (it would read and write other keys, and miss data).
    pub(super) fn refusal(&self, proxy: bool, extractor: u64, settings: &[(String, String)]) -> Option<String> {
        if extractor != self.settings.extractor_fingerprint {
            return Some(
                "its shard-id extractor differs from the coordinator's node (change extractors with a full \
                 cluster restart)"
                    .to_string(),
            );
        }
        if proxy {
            return None;
        }
        let differing = crate::sharding::settings::disagreement(&self.settings.must_agree, settings)?;
        Some(format!("a setting that must agree across nodes differs: {differing}"))
    }

    /// A region (or proxy) registers: refused with the reason [`CoordinatorCore::refusal`] gave
    /// (its shards then move off it) or ignored when it is not up; otherwise recorded, sent
    /// every known home and then the ack, and deferred allocations retried.
    pub(super) fn on_register(
        &mut self,
        region: RegionId,
        proxy: bool,
        refusal: Option<String>,
        now: Instant,
        wall_ms: u64,
        out: &mut Vec<CoordinatorAction>,
    ) {
        if let Some(reason) = refusal {
            // The region must not route: refused until a coordinator that agrees takes it.
            warn!(%region, %reason, "registration refused");
            self.rejected += 1;
            let refused = ToRegion::RegisterRefused { coordinator: self.me.clone(), reason: reason.clone() };
            self.commit(vec![], vec![Self::send(&region, refused)], out);
            // A region the state lists (registered with a predecessor that ran its
            // extractor and settings) still hosts shards: they move off it by hand-off, its
            // entities stopping first, as when it shuts down.
            self.shut_down_region(region, &format!("its region was refused: {reason}"), now, out);
            return;
        }
        if !self.members.status(&region).is_some_and(MemberStatus::is_up_or_leaving) {
            // A joining member retries; a Down or gone one must not come back.
            debug!(%region, "registration from a member that is not up; ignored");
            self.rejected += 1;
            return;
        }
        let known = if proxy { self.state.proxies.contains(&region) } else { self.state.regions.contains(&region) };
        let mut entries = Vec::new();
        if !known {
            info!(%region, proxy, "region registered");
            let rec = RegionRecord { region: region.clone(), proxy };
            entries.push((keys::region_entry(&region), Some(rmp_serde::to_vec(&rec).expect("region record encodes"))));
            if proxy {
                self.state.proxies.insert(region.clone());
            } else {
                self.state.regions.insert(region.clone());
            }
        }
        // Every known home first, in a few batches, then the ack: by the time the region asks
        // for the homes of the messages it buffered, it only asks for shards nobody hosts.
        let homes: Vec<(ShardId, RegionId, u64)> = self
            .state
            .shards()
            .iter()
            .filter(|(shard, _)| !self.handoffs.contains_key(*shard))
            .filter_map(|(shard, rec)| Some((shard.clone(), rec.region.clone()?, rec.epoch)))
            .collect();
        let mut effects: Vec<_> = homes
            .chunks(SHARD_HOMES_PER_MESSAGE)
            .map(|batch| Self::send(&region, ToRegion::ShardHomes { homes: batch.to_vec() }))
            .collect();
        effects.push(Self::send(&region, ToRegion::RegisterAck { coordinator: self.me.clone() }));
        self.commit(entries, effects, out);
        // Deferred allocations may find a home in a new region. Retrying on every registration
        // is one rule, and a no-op when nothing changed (a known region or a proxy).
        self.allocate_deferred(now, wall_ms, out);
    }
}
