//! The sections the registry lock is taken for: the lock mode of each, and
//! (with the feature `lock-stats`) the row its times are counted in. The
//! lowest file of the registry: it imports nothing.

/// What the registry lock is taken for: the mode, and (with the feature
/// `lock-stats`) where its hold time is counted.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Section {
    /// Publish an allocation's lower bound (exclusive).
    BeginAllocation,
    /// Record the IDs `nextval` handed out (exclusive).
    FinishAllocation,
    /// The same, when the entry's WAL position moves on to a newer record
    /// (rare): readers must not copy the new position with the old first
    /// ID it counts for (exclusive, moves the seqlock counter).
    FinishAllocationShift,
    /// Move a transaction's entries to the finished ring (exclusive).
    EndTransaction,
    /// A reader collects what its snapshot treats as in flight (shared).
    View,
    /// Forget finished entries every snapshot sees (exclusive).
    Prune,
    /// A stream's generation, for followers and the worker (shared).
    Generation,
    /// Anything else, rare: stream lookup and loading, worker slots,
    /// `in_flight()`.
    OtherShared,
    OtherExclusive,
}

impl Section {
    #[cfg(feature = "lock-stats")]
    pub const ALL: [Section; 9] = [
        Section::BeginAllocation,
        Section::FinishAllocation,
        Section::FinishAllocationShift,
        Section::EndTransaction,
        Section::View,
        Section::Prune,
        Section::Generation,
        Section::OtherShared,
        Section::OtherExclusive,
    ];

    #[cfg(feature = "lock-stats")]
    pub fn name(self) -> &'static str {
        match self {
            Section::BeginAllocation => "begin_allocation",
            Section::FinishAllocation => "finish_allocation",
            Section::FinishAllocationShift => "finish_allocation (shift)",
            Section::EndTransaction => "end_transaction",
            Section::View => "view",
            Section::Prune => "prune",
            Section::Generation => "generation",
            Section::OtherShared => "other (shared)",
            Section::OtherExclusive => "other (exclusive)",
        }
    }

    /// Does the section move or remove what lock-free readers copy (so
    /// that a copy it overlaps must be thrown away)? The two allocation
    /// sections only add: `begin_allocation` publishes a new entry (written
    /// whole before `used` counts it, `publish`), `finish_allocation`
    /// completes its own entry (its WAL position and first ID before
    /// `pending` turns false) and raises the highest allocated ID. A reader
    /// reads the highest allocated ID first: an entry published after that
    /// is for IDs above it, which the reader's answer never reaches (the
    /// lower bound's rule, docs/design.md), and one published before is in
    /// its copy, pending or complete. (A split, which adds an entry and
    /// takes the mark `allocating_from` off the earlier one, runs as
    /// `FinishAllocationShift`: a reader that counted the entries before
    /// the new one and read the mark after it went would hold neither.)
    pub fn moves_entries(self) -> bool {
        self.exclusive() && !matches!(self, Section::BeginAllocation | Section::FinishAllocation)
    }

    pub fn exclusive(self) -> bool {
        matches!(
            self,
            Section::BeginAllocation
                | Section::FinishAllocation
                | Section::FinishAllocationShift
                | Section::EndTransaction
                | Section::Prune
                | Section::OtherExclusive
        )
    }
}
