//! `ddshard admin`: the admin HTTP API from a terminal (feature `cli`). Each command is one
//! request; the answer prints as a table, or as the API's JSON with `--json`.

use std::fmt::Write as _;
use std::time::Duration;

use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::{MemberInfo, TypeInfo, TypeStats};
use crate::error::{Error, Result};
use crate::sharding::query::{AllocationTable, EntityLocation, RebalancePlan, ShardExplanation};

/// One `ddshard admin` command (also its command line: `ddshard admin <command>`).
#[derive(Debug, Clone, PartialEq, Eq, clap::Subcommand)]
pub enum AdminCommand {
    /// Members as the node sees them.
    Members,
    /// Entity types started on the node.
    Types,
    /// Shards and entities per region of a type, cluster-wide.
    Shards {
        /// The entity type.
        type_name: String,
    },
    /// The coordinator's allocation table of a type.
    Allocation {
        /// The entity type.
        type_name: String,
    },
    /// Why a shard is where it is.
    Explain {
        /// The entity type.
        type_name: String,
        /// The shard id.
        shard: String,
    },
    /// Where an entity lives (its shard, home and epoch).
    Locate {
        /// The entity type.
        type_name: String,
        /// The entity id.
        entity_id: String,
    },
    /// Run a rebalance round now, or show what it would do with --dry-run.
    Rebalance {
        /// The entity type.
        type_name: String,
        /// Only show the plan.
        #[arg(long)]
        dry_run: bool,
    },
    /// Ask a member to leave gracefully (sends DDSHARD_ADMIN_TOKEN).
    Leave {
        /// The member's node id.
        node_id: String,
    },
    /// Down a member, for one known to be dead (sends DDSHARD_ADMIN_TOKEN).
    Down {
        /// The member's node id.
        node_id: String,
    },
    /// A daemon process's revision and worker count; with --count, rescale it cluster-wide
    /// and wait for the new workers (sends DDSHARD_ADMIN_TOKEN).
    Daemon {
        /// The daemon process's name.
        name: String,
        /// The new number of workers.
        #[arg(long)]
        count: Option<usize>,
    },
    /// The replica holders durable quorums are counted over, members or not.
    Roster,
    /// Take a node that is gone for good out of the roster, so durable shards that wait for a
    /// majority of it are served again; what only its disk held is given up (sends
    /// DDSHARD_ADMIN_TOKEN).
    Forget {
        /// The node id (not a member now).
        node_id: String,
    },
}

/// Where and how `ddshard admin` talks to a node.
#[derive(Debug, Clone)]
pub struct AdminClient {
    /// The admin API's base URL, e.g. `http://127.0.0.1:8558`.
    pub url: String,
    /// Bearer token for mutating commands.
    pub token: Option<String>,
    /// Per-request timeout.
    pub timeout: Duration,
}

fn path_part(s: &str) -> String {
    // Percent-encode everything but unreserved characters (ids may hold anything).
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

impl AdminClient {
    fn request(&self, method: &str, path: &str, body: Option<&str>) -> Result<Value> {
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(self.timeout))
            .http_status_as_error(false)
            .build()
            .new_agent();
        let url = format!("{}{path}", self.url.trim_end_matches('/'));
        let auth = self.token.as_ref().map(|t| format!("Bearer {t}"));
        let answer = match method {
            "GET" => agent.get(&url).call(),
            _ => {
                let mut req = if method == "PUT" { agent.put(&url) } else { agent.post(&url) };
                if let Some(a) = &auth {
                    req = req.header("Authorization", a);
                }
                req.content_type("application/json").send(body.unwrap_or(""))
            }
        };
        let mut answer =
            answer.map_err(|e| Error::AdminApi { status: None, message: format!("{method} {url}: {e}") })?;
        let status = answer.status();
        let text = answer
            .body_mut()
            .read_to_string()
            .map_err(|e| Error::AdminApi { status: None, message: format!("{method} {url}: {e}") })?;
        let value: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        if !status.is_success() {
            let message = value.get("error").and_then(Value::as_str).map_or_else(|| value.to_string(), String::from);
            return Err(Error::AdminApi {
                status: Some(status.as_u16()),
                message: format!("{method} {path}: {status}: {message}"),
            });
        }
        Ok(value)
    }

    fn typed<T: DeserializeOwned>(value: Value) -> Result<T> {
        serde_json::from_value(value).map_err(|e| Error::Codec(format!("unexpected answer: {e}")))
    }

    /// Runs `command`; returns what to print (a table, or pretty JSON with `json`).
    pub fn run(&self, command: &AdminCommand, json: bool) -> Result<String> {
        let t = |name: &str| path_part(name);
        let value = match command {
            AdminCommand::Members => self.request("GET", "/cluster/members", None)?,
            AdminCommand::Types => self.request("GET", "/cluster/shards", None)?,
            AdminCommand::Shards { type_name } => {
                self.request("GET", &format!("/cluster/shards/{}", t(type_name)), None)?
            }
            AdminCommand::Allocation { type_name } => {
                self.request("GET", &format!("/cluster/shards/{}/allocation", t(type_name)), None)?
            }
            AdminCommand::Explain { type_name, shard } => {
                self.request("GET", &format!("/cluster/shards/{}/shards/{}/explain", t(type_name), t(shard)), None)?
            }
            AdminCommand::Locate { type_name, entity_id } => {
                self.request("GET", &format!("/cluster/shards/{}/entities/{}", t(type_name), t(entity_id)), None)?
            }
            AdminCommand::Rebalance { type_name, dry_run } => {
                let query = if *dry_run { "?dry_run=true" } else { "" };
                self.request("POST", &format!("/cluster/shards/{}/rebalance{query}", t(type_name)), None)?
            }
            AdminCommand::Leave { node_id } => {
                self.request("PUT", &format!("/cluster/members/{}", t(node_id)), Some(r#"{"operation":"leave"}"#))?
            }
            AdminCommand::Down { node_id } => {
                self.request("PUT", &format!("/cluster/members/{}", t(node_id)), Some(r#"{"operation":"down"}"#))?
            }
            AdminCommand::Daemon { name, count: None } => {
                self.request("GET", &format!("/cluster/daemons/{}", t(name)), None)?
            }
            AdminCommand::Daemon { name, count: Some(n) } => {
                self.request("PUT", &format!("/cluster/daemons/{}", t(name)), Some(&format!(r#"{{"count":{n}}}"#)))?
            }
            AdminCommand::Roster => self.request("GET", "/cluster/roster", None)?,
            AdminCommand::Forget { node_id } => {
                self.request("PUT", &format!("/cluster/members/{}", t(node_id)), Some(r#"{"operation":"forget"}"#))?
            }
        };
        if json {
            return serde_json::to_string_pretty(&value).map_err(|e| Error::Codec(e.to_string()));
        }
        render(command, value)
    }
}

fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_style(UTF8_FULL_CONDENSED).set_header(header.to_vec());
    t
}

fn node_of(region: &str) -> &str {
    region.split('#').next().unwrap_or(region)
}

/// The table (or lines) of one command's answer.
fn render(command: &AdminCommand, value: Value) -> Result<String> {
    Ok(match command {
        AdminCommand::Members => render_members(AdminClient::typed(value)?),
        AdminCommand::Types => {
            let types: Vec<TypeInfo> = AdminClient::typed(value)?;
            let mut t = table(&["type", "proxy here"]);
            for ty in types {
                t.add_row(vec![ty.type_name, ty.proxy.to_string()]);
            }
            t.to_string()
        }
        AdminCommand::Shards { .. } => render_shards(&AdminClient::typed(value)?),
        AdminCommand::Allocation { .. } => render_allocation(&AdminClient::typed(value)?),
        AdminCommand::Explain { .. } => render_explanation(&AdminClient::typed(value)?),
        AdminCommand::Locate { .. } => {
            let l: EntityLocation = AdminClient::typed(value)?;
            let mut t = table(&["type", "entity", "shard", "home", "epoch"]);
            t.add_row(vec![l.type_name, l.entity_id, l.shard, l.home.unwrap_or_default(), l.epoch.to_string()]);
            t.to_string()
        }
        AdminCommand::Rebalance { .. } => render_plan(&AdminClient::typed(value)?),
        AdminCommand::Leave { node_id } => format!("{node_id}: leave requested"),
        AdminCommand::Down { node_id } => format!("{node_id}: downed"),
        AdminCommand::Daemon { name, .. } => {
            let scale: crate::sharding::DaemonScale = AdminClient::typed(value)?;
            let mut t = table(&["daemon process", "revision", "workers", "rescaling to"]);
            let rescaling = scale.rescaling_to.map(|n| n.to_string()).unwrap_or_default();
            t.add_row(vec![name.clone(), scale.revision.to_string(), scale.count.to_string(), rescaling]);
            t.to_string()
        }
        AdminCommand::Roster => {
            let roster: Vec<crate::admin::RosterInfo> = AdminClient::typed(value)?;
            let mut t = table(&["node", "generation", "member"]);
            for r in roster {
                let member = if r.member { "yes" } else { "no (still counted)" };
                t.add_row(vec![r.node_id, r.generation.to_string(), member.to_string()]);
            }
            t.to_string()
        }
        AdminCommand::Forget { node_id } => format!("{node_id}: forgotten; its copies no longer count"),
    })
}

fn render_members(members: Vec<MemberInfo>) -> String {
    let mut t = table(&["node", "status", "reachable", "roles", "version", "up #", "address"]);
    for m in members {
        let reachable = if m.reachable {
            "yes".to_string()
        } else {
            format!("no (by {})", m.unreachable_by.iter().map(|r| node_of(r)).collect::<Vec<_>>().join(", "))
        };
        let up = m.up_number.map(|n| n.to_string()).unwrap_or_default();
        let node = if m.is_self { format!("{} *", m.node_id) } else { m.node_id };
        t.add_row(vec![node, m.status, reachable, m.roles.join(","), m.app_version, up, m.address]);
    }
    t.to_string()
}

fn render_shards(stats: &TypeStats) -> String {
    let mut t = table(&["region", "shards", "entities"]);
    for (region, shards) in &stats.regions {
        t.add_row(vec![region.clone(), shards.len().to_string(), shards.values().sum::<usize>().to_string()]);
    }
    let mut out = t.to_string();
    if !stats.failed.is_empty() {
        let _ = write!(out, "\nno answer from: {}", stats.failed.join(", "));
    }
    out
}

fn render_allocation(a: &AllocationTable) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "type {} — coordinator {}", a.type_name, a.coordinator);
    let mut regions = table(&["region", "status", "version", "shards", "takes new shards"]);
    for r in &a.regions {
        let status = r.member_status.clone().unwrap_or_default();
        let shards = r.shards.to_string();
        regions.add_row(vec![r.region.clone(), status, r.app_version.clone(), shards, r.takes_new_shards.to_string()]);
    }
    let _ = writeln!(out, "{regions}");
    let mut shards = table(&["shard", "home", "epoch", "hand-off"]);
    for s in &a.shards {
        let hand_off =
            s.hand_off.as_ref().map(|h| format!("{} from {}", h.phase, node_of(&h.from))).unwrap_or_default();
        shards.add_row(vec![s.shard.clone(), s.region.clone().unwrap_or_default(), s.epoch.to_string(), hand_off]);
    }
    let _ = writeln!(out, "{shards}");
    let _ = match &a.rebalance.blocked_by {
        None => write!(out, "next rebalance in {} ms", a.rebalance.next_round_in_ms),
        Some(why) => write!(out, "rebalance blocked: {why}"),
    };
    out
}

fn render_explanation(e: &ShardExplanation) -> String {
    let mut out = String::new();
    let home = e.home.clone().map_or_else(|| "no home".into(), |h| format!("on {h}, epoch {}", e.epoch));
    let _ = writeln!(out, "{} shard {}: {home}", e.type_name, e.shard);
    if let Some(c) = &e.if_allocated_now {
        let _ = writeln!(out, "if allocated now: {} ({})", c.region, c.reason);
    }
    let _ = match &e.next_rebalance {
        Some(m) => writeln!(out, "next rebalance: moves it to {} ({})", m.expected_to, m.reason),
        None => writeln!(out, "next rebalance: leaves it"),
    };
    let mut regions = table(&["region", "shards", "eligible"]);
    for r in &e.regions {
        let eligible = r.not_eligible_because.clone().unwrap_or_else(|| "yes".into());
        regions.add_row(vec![r.region.clone(), r.shards.to_string(), eligible]);
    }
    let _ = writeln!(out, "{regions}");
    let mut history = table(&["at (ms)", "event", "region", "reason"]);
    for h in &e.history {
        history.add_row(vec![h.at_ms.to_string(), h.kind.clone(), h.region.clone(), h.reason.clone()]);
    }
    let _ = write!(out, "{history}");
    out
}

fn render_plan(p: &RebalancePlan) -> String {
    let mut out = String::new();
    let verb = if p.executed { "started" } else { "would start" };
    if let Some(why) = &p.blocked_by {
        let _ = write!(out, "no rebalance: {why}");
    } else {
        let _ = writeln!(out, "{} {verb} {} hand-off(s)", p.type_name, p.moves.len());
        let mut t = table(&["shard", "from", "to", "reason"]);
        for m in &p.moves {
            t.add_row(vec![m.shard.clone(), m.from.clone(), m.expected_to.clone(), m.reason.clone()]);
        }
        let _ = write!(out, "{t}");
    }
    out
}
