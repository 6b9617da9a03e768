"""A fixed text for perplexity, written for this project (so no model was trained on it):
plain English prose of 987 tokens in the default model's tokenizer. Wrapped here; each
paragraph is one line of the text (`HELD_TEXT`)."""

_WRAPPED = """\
The yard lies in a shallow valley east of the river, where three lines meet and the land was
flat enough to lay forty tracks side by side. By day it looks like nothing much: rows of
freight cars, a brick tower with narrow windows, a canteen that sells soup and strong tea.
At night it becomes a machine the size of a village, and the people who run it speak of it
the way sailors speak of weather.

Every train that arrives is taken apart. A shunting engine pushes the whole string of cars
slowly up a low artificial hill called the hump, and at the crest a worker lifts the
coupling pin between two cars. The freed car rolls down the far side on its own weight, and
the tower sets the switches beneath it so that it curves into one of the sorting tracks
below. Cars bound for the port go to one track, cars for the steel mill to another, empty
grain hoppers to a third. When a track holds enough cars for one destination, a crew couples
them into a new train, tests the brakes from end to end, and sends it out toward the main
line.

The hard part is speed. A loaded car of coal is heavy and gathers momentum quickly; an empty
box car is light and catches the wind. If a heavy car runs too fast it strikes the cars
already standing on its track hard enough to break couplings or spill a load. If a light car
runs too slowly it stops short in the middle of the switches, and everything behind it must
wait while someone walks out with a lamp to push it clear. For most of the last century the
answer was a row of men standing beside the tracks with long wooden poles, jamming them
against the wheels to slow the cars by feel. Later came retarders, long steel jaws along the
rails that squeeze the wheels as a car passes, their pressure set by an operator who judged
each car by its weight, its wheels and the sound it made.

Today the tower measures each car as it crests the hump. Radar reads its speed, a scale
under the rails reads its weight, and a small computer predicts how far it will roll before
it meets the cars ahead. The retarders open and close in fractions of a second. Still, the
old operators insist that no formula captures everything. Cold mornings make the grease in
the bearings stiff, so the first cars of the day roll short. Wet rails after a summer storm
let the retarders slip. A car with a flat spot on one wheel thumps as it passes and loses
speed in a way the model never expects. The good operators watch the screens and listen
through the open window at the same time.

There is a rule in the yard that nothing moves without a plan, and a second rule that the
plan is always wrong by morning. Trains arrive late, or early, or with cars nobody ordered.
A tank car with a leaking valve must be set aside on the repair track before anything else
can happen. A crew calls in sick, and two trains that were meant to leave an hour apart must
wait for the same engineer. The yardmaster keeps a list on a clipboard, crossed out and
rewritten through the night, of which tracks are filling, which are nearly full, and which
trains can be built from what is on hand. Space is always the scarce thing. A track that is
full cannot take another car, and a yard with no free track stops sorting altogether,
however fast the hump can run.

So the yardmaster thinks about space the way a shopkeeper thinks about shelves. Long trains
that will leave soon get the long tracks near the departure end. Small groups of cars for
rare destinations are packed together on a single track and separated later, a trick the
crews call doubling. When the yard grows crowded, the first thing to go is comfort: cars are
stored closer together, spare tracks are given up, and slow work is put off until the rush
is over. The trick, as one old hand put it, is never to let the yard fill all at once. A
yard that is ninety percent full still works. A yard that is full simply waits, and every
train outside it waits too.

Near dawn the pace slackens. The last outbound trains are tested and released, their red
tail lamps shrinking toward the bridge. The hump engine returns to the shed, and the crews
walk back along the gravel paths with their lanterns swinging, talking about the car that
rolled short, the coupling that would not hold, the train that came in with two engines and
left with one. Inside the tower the night shift writes up the log: how many cars were
sorted, which tracks were cleared, what was broken and who fixed it. Then the day shift
climbs the stairs, looks out over the forty tracks, and starts a new plan that will also be
wrong by evening.
"""

HELD_TEXT = "\n\n".join(" ".join(p.split("\n")) for p in _WRAPPED.strip().split("\n\n")) + "\n"
